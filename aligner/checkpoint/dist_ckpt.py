"""Checkpoints: megatron-core dist checkpointing (reshards TP/PP on load), written atomically.

Layout of one checkpoint directory:
    <root>/step_000012/model/            megatron dist checkpoint of the model (torch_dist format)
    <root>/step_000012/optim/            the optimizer: megatron dist checkpoint on GPU (megatron optimizer);
                                         on CPU one torch file per rank (same layout required to resume it)
    <root>/step_000012/state.json        trainer state (step, consumed samples, KL controller, ...), rank 0
    <root>/step_000012/rng/rank_K.pt     RNG states per global rank
Every rank writes under `<root>/.tmp-step_000012`; after a barrier rank 0 writes `state.json` last and renames the
directory into place, so a directory named `step_*` is always complete; `latest_checkpoint(root)` finds the newest.

Contract: `save(root, step, models, optimizer, state)` and `load(path, models, optimizer)` are collective over the
whole world (every rank calls them); `models` is a list of megatron modules (the bare GPTModel slices).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from aligner.parallel.device import on_gpu

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_writer_manager = None  # the helper started by start_writer (kept alive for the whole process)


def _helper_init() -> None:
    """Runs first in the helper process. It ignores the signals that ask a job to stop (Slurm and our launchers send
    them to every process of the job, and the job then saves a last checkpoint through this helper), and it ends
    when the job process that started it ends, however that ends (SIGKILL included; Linux): without that an
    orphaned helper outlives a killed job."""
    import ctypes
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the job ended before the line above ran
        os._exit(0)


def start_writer() -> None:
    """Start now, from the main thread, the helper process that megatron's checkpoint writer would otherwise start
    at this process's first save; jobs that save (the actor, the critic) call it at start-up.

    megatron-core's filesystem writer (used by every torch_dist save, synchronous ones too) creates a multiprocessing
    Manager with the 'spawn' start method on first use: a fresh interpreter that imports the main script and torch,
    and the save waits for it: the demo critic's first save took 1.87 s on a 2-core CPU, later ones 0.06 s
    (scripts/bench_checkpoint_writer.py, docs/PERF.md),
    longer when several ranks do it at once, and inside a critic_save request Triton's python stub waits all that
    time. megatron's own helper also dies of the SIGTERM that asks the job to checkpoint and stop (so that last save
    fails), and outlives a job killed with SIGKILL; this one ignores the first and ends with the job.
    A no-op where megatron's private hook is not there (other megatron-core versions).
    """
    global _writer_manager
    try:
        import multiprocessing as mp
        from multiprocessing.managers import SyncManager

        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from torch.distributed.checkpoint.storage import WriteResult
    except ImportError:
        return
    if _writer_manager is not None or getattr(filesystem_async, "_results_queue", "missing") is not None:
        return  # started already, or not this megatron-core
    manager = SyncManager(ctx=mp.get_context("spawn"))
    manager.start(_helper_init)
    results = manager.Queue()
    # A round trip of a torch checkpoint class (pickled by name) waits until the helper has imported it.
    results.put(WriteResult)
    results.get()
    _writer_manager = manager
    filesystem_async._results_queue = results


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root` (a `step_*` directory with a state.json), or None."""
    if not root or not os.path.isdir(root):
        return None
    steps = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "state.json")):
            steps.append((int(m.group(1)), name))
    return os.path.join(root, max(steps)[1]) if steps else None


def rng_state() -> dict:
    """Every RNG state of this process as tensors and plain numbers (loads with `weights_only=True`)."""
    from megatron.core import tensor_parallel

    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "megatron_tracker": dict(tensor_parallel.get_cuda_rng_tracker().get_states()),
    }
    if on_gpu():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (npy["name"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["gauss"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and on_gpu():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def _model_sharded_state(models) -> dict:
    if len(models) == 1:
        return models[0].sharded_state_dict()
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def save(
    root: str,
    step: int,
    models,
    optimizer=None,
    state: dict | None = None,
    keep: int | None = None,
    model_cfg=None,
    files: dict[str, str] | None = None,
) -> str:
    """Write `<root>/step_<step>` atomically; returns its path. Collective.

    With `model_cfg` (a ModelConfig), `model.yaml` describes the model, so the checkpoint converts to HF
    (scripts/convert_nemo_to_hf.py) or loads elsewhere without further arguments. `files` ({name: text}, rank 0's)
    are written beside it, inside the same atomic rename (e.g. a reward model's `reward_stats.json`)."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(os.path.join(tmp, "model"))
        os.makedirs(os.path.join(tmp, "optim"))
        os.makedirs(os.path.join(tmp, "rng"))
    _barrier()
    dist_checkpointing.save(_model_sharded_state(models), os.path.join(tmp, "model"))
    if optimizer is not None:
        optimizer.save(os.path.join(tmp, "optim"), _model_sharded_state(models))
    torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{_rank()}.pt"))
    _barrier()
    if _rank() == 0:
        if model_cfg is not None:
            from aligner.config import to_yaml

            with open(os.path.join(tmp, "model.yaml"), "w") as f:
                f.write(to_yaml(model_cfg))
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        with open(os.path.join(tmp, "state.json"), "w") as f:  # last: its presence marks a complete checkpoint
            json.dump({"step": step, **(state or {})}, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:
            _prune(root, keep)
    _barrier()
    return final


def _prune(root: str, keep: int) -> None:
    done = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_state(path: str) -> dict:
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


@torch.no_grad()  # megatron copies loaded optimizer state into views of leaf parameters
def load(path: str, models, optimizer=None, restore_rng: bool = True) -> dict:
    """Load a checkpoint written by `save` into `models` (any TP/PP layout) and `optimizer` (if given).

    Returns the trainer state dict. Collective.
    """
    from megatron.core import dist_checkpointing

    if not os.path.isfile(os.path.join(path, "state.json")):
        raise FileNotFoundError(f"{path} is not a complete aligner checkpoint (no state.json)")
    sharded = _model_sharded_state(models)
    loaded = dist_checkpointing.load(sharded, os.path.join(path, "model"))
    if len(models) == 1:
        models[0].load_state_dict(loaded, strict=False)
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded[f"model{i}"], strict=False)
    if optimizer is not None:
        optimizer.load(os.path.join(path, "optim"), _model_sharded_state(models))
    rng_file = os.path.join(path, "rng", f"rank_{_rank()}.pt")
    if restore_rng and os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=True))
    return read_state(path)


def model_dir(path: str) -> str:
    """The model part of a checkpoint: `<path>/model` of a job checkpoint, or `<path>` itself (a converted model)."""
    return os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path


def stored_shapes(path: str) -> dict[str, tuple]:
    """{tensor name: global shape} of the model stored at `path` (from the metadata alone)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return {
        k: tuple(v.global_shape)
        for k, v in load_tensors_metadata(model_dir(path)).items()
        if hasattr(v, "global_shape") and not k.endswith("_extra_state")
    }


def head_kind(path: str) -> str:
    """'scalar' when the stored output layer is [1, hidden] (a reward model or critic), else 'lm' (a policy: an LM
    head [V, hidden], or none when the embeddings are tied)."""
    shape = stored_shapes(path).get("output_layer.weight")
    return "scalar" if shape is not None and shape[0] == 1 else "lm"


def load_model_weights(path: str, models) -> None:
    """Load only the model weights (e.g. a converted HF checkpoint: `<path>/model` or `<path>` itself)."""
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
    if not os.path.isfile(os.path.join(model_dir, "metadata.json")):
        raise FileNotFoundError(f"{model_dir} is not a megatron dist checkpoint (no metadata.json)")
    sharded = _model_sharded_state(models)
    loaded = dist_checkpointing.load(sharded, model_dir)
    if len(models) == 1:
        models[0].load_state_dict(loaded, strict=False)
    else:
        for i, m in enumerate(models):
            m.load_state_dict(loaded[f"model{i}"], strict=False)


def load_backbone_weights(path: str, models) -> None:
    """Like `load_model_weights`, but leaves the output layer as built: initialises a model whose head differs from
    the checkpoint's, e.g. a critic (scalar head) from a converted policy (LM head), as NeMo-Aligner's
    `load_base_model_only` does. The embedding, all layers and the final norm are loaded."""
    from megatron.core import dist_checkpointing

    model_dir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
    if not os.path.isfile(os.path.join(model_dir, "metadata.json")):
        raise FileNotFoundError(f"{model_dir} is not a megatron dist checkpoint (no metadata.json)")

    def backbone(state: dict) -> dict:
        return {k: v for k, v in state.items() if not k.startswith("output_layer.")}

    sharded = [backbone(m.sharded_state_dict()) for m in models]
    if len(models) == 1:
        models[0].load_state_dict(dist_checkpointing.load(sharded[0], model_dir), strict=False)
    else:
        loaded = dist_checkpointing.load({f"model{i}": s for i, s in enumerate(sharded)}, model_dir)
        for i, m in enumerate(models):
            m.load_state_dict(loaded[f"model{i}"], strict=False)
