"""GPU check (run by hand on a GPU machine, not collected by pytest): megatron's distributed optimizer state
through aligner.checkpoint.dist_ckpt — save after a step, load into fresh objects, compare weights and the next
step's result; then a save the OS refuses (a file-size limit) is one CheckpointWriteError and leaves nothing.
Prints PASS/FAIL lines.

    python tests/gpu/ckpt_roundtrip.py /tmp/ckpt
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(root, distributed=True):
    from aligner.checkpoint import dist_ckpt
    from aligner.config import ModelConfig, OptimConfig
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(seed=1)
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        ffn_hidden_size=256,
        params_dtype="bfloat16",
    )
    tokens = torch.randint(0, 100, (4, 16), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    micro = [{"tokens": tokens}]

    def loss_fn(batch, out):
        return out.float().pow(2).mean(), {}

    ocfg = OptimConfig(lr=1e-3, use_distributed_optimizer=distributed)
    a = TrainableModel(cfg, ocfg)
    a.step(micro, loss_fn)
    path = dist_ckpt.save(root, 1, [a.module], a.optimizer, {"x": 1})
    next_a = a.step(micro, loss_fn)["grad_norm"]
    b = TrainableModel(cfg, ocfg)
    state = dist_ckpt.load(path, [b.module], b.optimizer)
    b.steps_taken = 1
    next_b = b.step(micro, loss_fn)["grad_norm"]
    pairs = [(k, x, b.module.state_dict()[k]) for k, x in a.module.state_dict().items() if torch.is_tensor(x)]
    diff = max((x.float() - y.float()).abs().max().item() for _, x, y in pairs)
    same = diff == 0.0
    print("distributed optimizer" if distributed else "plain megatron optimizer", "max |weight diff|", diff)
    print("state", state)
    print(
        "PASS" if same and abs(next_a - next_b) < 1e-6 else "FAIL",
        "weights equal after the resumed step:",
        same,
        "grad norms",
        next_a,
        next_b,
    )
    write_failure(root, a, dist_ckpt)


def write_failure(root, a, dist_ckpt):
    """A save that the OS refuses (files may not grow past 1 KiB: EFBIG, as a full disk gives ENOSPC) is one
    CheckpointWriteError with nothing of it left, through megatron's GPU save path; the next save is whole."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    try:
        dist_ckpt.save(root, 2, [a.module], a.optimizer, {"x": 2})
        error = None
    except dist_ckpt.CheckpointWriteError as exc:
        error = str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    left = sorted(n for n in os.listdir(root) if n.endswith("step_000002"))
    again = dist_ckpt.verify(dist_ckpt.save(root, 2, [a.module], a.optimizer, {"x": 2}))
    ok = error is not None and error.startswith("cannot write checkpoint") and not left and again is None
    print("PASS" if ok else "FAIL", "a refused write:", error, "| left:", left, "| saved again:", again)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/ckpt", distributed=sys.argv[2:3] != ["plain"])
