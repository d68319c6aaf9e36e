"""Checkpoint saves start no helper process: megatron's filesystem writer would create its results queue as a
'spawn' multiprocessing Manager (a second interpreter importing torch, per job) at the first save; dist_ckpt gives it
a queue of this process instead (our saves are synchronous: the same process puts and takes the results). Run in a
fresh interpreter, as a job starts: a queue is created once per process, so the pytest process (where other tests
saved already) cannot show it. The saved checkpoint loads back; a write that fails in megatron's write workers
(a file-size limit: a real EFBIG from the OS) is one CheckpointWriteError naming the cause and the free space, with
nothing of it left.
"""

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BODY = textwrap.dedent("""
    import os, queue, resource, signal, sys
    sys.path.insert(0, {repo!r})

    def main():
        import psutil
        import torch
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from aligner.checkpoint import dist_ckpt
        from aligner.config import ModelConfig
        from aligner.models.gpt import build_gpt
        from aligner.parallel import initialize
        from aligner.utils.net import free_port_range

        initialize(1, 1, master_port=free_port_range(1))
        assert filesystem_async._results_queue is None, "a results queue exists before the first save"
        model = build_gpt(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64))
        path = dist_ckpt.save(sys.argv[1], 1, [model])
        results = filesystem_async._results_queue
        print("queue", type(results).__module__, results.qsize())
        print("children", len(psutil.Process().children(recursive=True)))
        before = {{k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}}
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        dist_ckpt.load_model_weights(path, [model])
        after = model.state_dict()
        print("loaded back", all(torch.equal(after[k], v) for k, v in before.items()))
        # A real write failure: files of this process and the write workers it forks may not grow past 1 KiB
        # (EFBIG, "File too large", as a full disk gives ENOSPC), the signal that would kill the writer ignored.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
        try:
            dist_ckpt.save(sys.argv[1], 2, [model])
            print("second save: no error")
        except dist_ckpt.CheckpointWriteError as exc:
            print("second save failed:", exc)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        print("left", sorted(os.listdir(sys.argv[1])))
        print("complete", [n for _, n in dist_ckpt.complete_checkpoints(sys.argv[1])])
        dist_ckpt.save(sys.argv[1], 3, [model])
        print("third save", dist_ckpt.verify(os.path.join(sys.argv[1], "step_000003")))

    if __name__ == "__main__":
        main()
""")


def test_saves_start_no_helper_process_and_load_back(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(BODY.format(repo=REPO))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt")], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "queue queue 0" in proc.stdout, proc.stdout  # a queue.Queue, left empty
    assert "children 0" in proc.stdout, proc.stdout  # no Manager process, no write worker left
    assert "loaded back True" in proc.stdout, proc.stdout
    # the write workers' OS error reaches the save as one line naming the cause, every part of step 2 removed
    assert "second save failed: cannot write checkpoint" in proc.stdout, proc.stdout
    assert "GiB free there now" in proc.stdout, proc.stdout
    assert "left ['step_000001']" in proc.stdout, proc.stdout
    assert f"complete ['{tmp_path / 'ckpt' / 'step_000001'}']" in proc.stdout, proc.stdout
    assert "third save None" in proc.stdout, proc.stdout  # and the next save (space freed) is whole
