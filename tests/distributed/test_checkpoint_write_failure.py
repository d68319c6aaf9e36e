"""A checkpoint write that fails on one rank only (a real OS limit: files of rank 1 may not grow past 1 KiB, EFBIG,
as a full local disk gives ENOSPC) stops every rank at the same point with one CheckpointWriteError naming that rank:
no rank waits forever for the others, nothing of the step is left, the step before stays complete, and the next save
(the limit lifted, as after freeing space) is whole. Two real processes on gloo, megatron's own writer."""

from dist import run_ranks


def _save_with_rank1_limited(rank, world_size, root):
    import os
    import resource
    import signal

    import torch.distributed as dist

    from aligner.checkpoint import dist_ckpt
    from aligner.config import ModelConfig
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize, shutdown

    initialize()
    model = build_gpt(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64))
    dist_ckpt.save(root, 1, [model])
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    try:
        dist_ckpt.save(root, 2, [model])
        error = None
    except dist_ckpt.CheckpointWriteError as exc:
        error = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()  # both ranks back from the failed save before either looks ...
    left = sorted(os.listdir(root))
    dist.barrier()  # ... and both looked before either starts the next one (its .tmp-step_000003)
    dist_ckpt.save(root, 3, [model])
    problems = [dist_ckpt.verify(os.path.join(root, f"step_00000{s}")) for s in (1, 3)]
    shutdown()
    return error, left, problems


def test_a_write_failing_on_one_rank_stops_every_rank_alike(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(_save_with_rank1_limited, 2, root, timeout=240)
    for error, left, problems in results:
        assert error is not None and error.startswith(f"cannot write checkpoint {root}/step_000002 (global rank 1): ")
        assert "GiB free there now" in error and "set checkpoint.dir elsewhere" in error
        assert left == ["step_000001"]  # no .tmp-step_000002, no step_000002
        assert problems == [None, None]
    assert results[0][0] == results[1][0]
