"""Checkpoints: megatron-core dist checkpointing (reshards TP/PP on load), written atomically.

Layout of one checkpoint directory:
    <root>/step_000012/model/            megatron dist checkpoint of the model (torch_dist format)
    <root>/step_000012/optim/            the optimizer: megatron dist checkpoint on GPU (megatron optimizer);
                                         on CPU one torch file per rank (same layout required to resume it)
    <root>/step_000012/state.json        trainer state (step, consumed samples, KL controller, ...), rank 0
    <root>/step_000012/rng/rank_K.pt     RNG states per global rank
    <root>/step_000012/manifest.json     every other file's size, written just before state.json
Every rank writes under `<root>/.tmp-step_000012`; after a barrier rank 0 writes the manifest, then `state.json` last,
and renames the directory into place, so a directory named `step_*` is always complete when written. A write that
fails on any rank (a full disk, a file-size limit, no write access) raises `CheckpointWriteError` on every rank at the
same point, naming the rank and the cause, with the `.tmp-` directory removed.
`verify(path)` tells whether it is still intact (a truncated or missing file is named); `latest_checkpoint(root)`
finds the newest complete one. Which steps of a run the actor and the critic *both* completed is recorded by
aligner.checkpoint.run (the run's commit record), not here.

Contract: `save(root, step, models, optimizer, state)` and `load(path, models, optimizer)` are collective over the
whole world (every rank calls them); `models` is a list of megatron modules (the bare GPTModel slices).

Loading is strict (`load`, `load_model_weights`, `load_backbone_weights`): before any data is read, the tensors the
model holds (keys and global shapes of every rank's sharded state dict, gathered over the world) are compared with
those the checkpoint stores (its metadata), and a missing, unexpected or mis-shaped tensor raises
`CheckpointMismatchError` (a CheckpointError) naming it, on every rank alike (megatron's own default ignores tensors
the model does not ask for, e.g. Qwen2's q/k/v biases under a config without add_qkv_bias). The one documented
exception is `load_backbone_weights`, which leaves the output layer as built (a critic from a policy). Vocabulary
rows are padded per layout, so those tensors may differ in their first dimension.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from aligner.parallel.device import on_gpu

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged or not the one expected; the message names the file."""


class CheckpointMismatchError(CheckpointError):
    """A tensor is missing, unexpected or has a shape its config does not imply."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a file-size limit, no write access): raised on every rank
    alike, its partial directory removed, the checkpoints written before it untouched."""


# A stored or expected tensor that usually means one ModelConfig key disagrees with the checkpoint.
_HINTS = (
    ("linear_qkv.bias", "model.add_qkv_bias"),
    ("q_layernorm", "model.qk_layernorm"),
    ("k_layernorm", "model.qk_layernorm"),
    ("output_layer.weight", "model.tie_embeddings, or a policy vs a reward-model checkpoint"),
    ("position_embeddings", "model.arch"),
    ("layer_norm_bias", "model.arch"),
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def use_local_results_queue() -> None:
    """Give megatron's checkpoint writer a results queue that lives in this process, before the first save.

    megatron-core's filesystem writer (every torch_dist save) passes each save's write results through a module-level
    queue that it creates on first use as a 'spawn' multiprocessing Manager: a helper interpreter that imports the
    main script and torch (a 2-core CPU: 1.87 s inside the demo critic's first save, ~3.5 s of CPU per job,
    docs/PERF.md), that dies of the SIGTERM asking a job to checkpoint and stop (so that last save fails) and
    outlives a job killed with SIGKILL. That queue has to cross processes only for megatron's asynchronous saves,
    whose writes run in a background process. Ours are synchronous (dist_checkpointing.save runs the request with
    `execute_sync`): this process puts the results and takes them back itself (the write workers it forks report
    through a queue of their own), so a plain thread-safe queue does the same job without any helper process. A
    no-op where megatron's private hook is not there (other megatron-core versions: they start their own helper).
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        return
    if getattr(filesystem_async, "_results_queue", "missing") is None:
        filesystem_async._results_queue = queue.Queue()


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every `step_*` directory with a state.json under `root`, oldest first."""
    if not root or not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "state.json")):
            out.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(out)


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint under `root` (a `step_*` directory with a state.json), or None."""
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


def _files(path: str) -> dict[str, int]:
    out = {}
    for here, _, names in os.walk(path):
        for name in names:
            full = os.path.join(here, name)
            rel = os.path.relpath(full, path)
            if rel not in (MANIFEST, "state.json"):
                out[rel] = os.path.getsize(full)
    return out


def verify(path: str) -> str | None:
    """None when the checkpoint at `path` is complete and intact; otherwise what is wrong, naming the file."""
    state = os.path.join(path, "state.json")
    if not os.path.isfile(state):
        return f"{path} is not a complete checkpoint (no state.json)"
    try:
        with open(state) as f:
            json.load(f)
    except (OSError, ValueError) as exc:
        return f"{state} is unreadable ({exc})"
    return verify_files(path)


def write_manifest(path: str) -> None:
    """Record the size of every file under `path` (call on the finished directory, before it is renamed)."""
    with open(os.path.join(path, MANIFEST), "w") as f:
        json.dump(_files(path), f, indent=0, sort_keys=True)


def verify_files(path: str) -> str | None:
    """None when every file the manifest of `path` lists is there with its size (or there is no manifest)."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        return None  # written before manifests existed: state.json is all there is to check
    try:
        with open(manifest) as f:
            expected = json.load(f)
    except (OSError, ValueError) as exc:
        return f"{manifest} is unreadable ({exc})"
    for rel, size in sorted(expected.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            return f"{full} is missing"
        actual = os.path.getsize(full)
        if actual != size:
            return f"{full} has {actual} bytes, {size} were written (truncated or replaced)"
    return None


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
    replace: bool = True,
    files: dict[str, str] | None = None,
) -> str:
    """Write `<root>/step_<step>` atomically; returns its path. Collective.

    With `model_cfg` (a ModelConfig), `model.yaml` describes the model, so the checkpoint converts to HF
    (scripts/convert_nemo_to_hf.py) or loads elsewhere without further arguments. With `replace=False` an existing
    complete checkpoint of that step is an error (FileExistsError, before anything is written). `files`
    ({name: text}, rank 0's) are written beside it, inside the same atomic rename (e.g. a reward model's
    `reward_stats.json`)."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, step_dir_name(step))
    tmp = os.path.join(root, ".tmp-" + step_dir_name(step))
    if not replace and os.path.isfile(os.path.join(final, "state.json")):
        raise FileExistsError(f"{final} exists and is complete: a checkpoint is never overwritten")

    def make_dirs():
        if _rank() == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
            for part in ("model", "optim", "rng"):
                os.makedirs(os.path.join(tmp, part))

    def write_shards():
        use_local_results_queue()
        dist_checkpointing.save(_model_sharded_state(models), os.path.join(tmp, "model"))
        if optimizer is not None:
            optimizer.save(os.path.join(tmp, "optim"), _model_sharded_state(models))
        torch.save(rng_state(), os.path.join(tmp, "rng", f"rank_{_rank()}.pt"))

    def finish():
        if _rank() != 0:
            return
        if model_cfg is not None:
            from aligner.config import to_yaml

            with open(os.path.join(tmp, "model.yaml"), "w") as f:
                f.write(to_yaml(model_cfg))
        for name, text in (files or {}).items():
            with open(os.path.join(tmp, name), "w") as f:
                f.write(text)
        write_manifest(tmp)
        with open(os.path.join(tmp, "state.json"), "w") as f:  # last: its presence marks a complete checkpoint
            json.dump({"step": step, **(state or {})}, f, indent=1)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep:
            _prune(root, keep)

    # Each part is followed by every rank's word on it (which also stands for the barrier between the parts): a
    # write that fails on one rank (a full disk, a file-size limit) stops all of them at the same place.
    for part in (make_dirs, write_shards, finish):
        _all_succeeded(_attempt(part), final, tmp)
    return final


def _attempt(part) -> str | None:
    """Run one part of a save on this rank: None, or what went wrong (its innermost cause, in one line)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        part()
    except (Exception, CheckpointException) as exc:  # torch's CheckpointException is a BaseException
        return _root_cause(exc)
    return None


def _root_cause(exc: BaseException) -> str:
    """The innermost error under megatron's and torch's wrappers (a write worker's OSError, say), in one line."""
    failures = getattr(exc, "failures", None)  # torch's CheckpointException: {rank: (exception, traceback)}
    if failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]


def _all_succeeded(problem: str | None, final: str, tmp: str) -> None:
    """Collective: return when every rank's part succeeded; otherwise every rank raises CheckpointWriteError
    naming the first failed rank's problem, once rank 0 has removed the partial directory."""
    problems = [problem]
    if dist.is_initialized():
        from aligner.parallel import host_group

        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem, group=host_group())
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():  # every rank raises with the partial directory gone
        from aligner.parallel import host_barrier

        host_barrier()
    rank, what = failed[0]
    where = f" (global rank {rank})" if len(problems) > 1 else ""
    try:  # torch's own file writer reports a full disk as a bare "iostream error": the free space tells
        free = f"; {shutil.disk_usage(os.path.dirname(final)).free / 2**30:.1f} GiB free there now"
    except OSError:
        free = ""
    raise CheckpointWriteError(
        f"cannot write checkpoint {final}{where}: {what}{free}. Nothing of it is kept and earlier checkpoints are "
        "intact: free space on that disk (or give write access), or set checkpoint.dir elsewhere, then resume"
    )


def _prune(root: str, keep: int) -> None:
    done = sorted(n for n in os.listdir(root) if _STEP_DIR.match(n))
    for name in done[:-keep]:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_state(path: str) -> dict:
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


@torch.no_grad()  # megatron copies loaded optimizer state into views of leaf parameters
def load(path: str, models, optimizer=None, restore_rng: bool = True) -> dict:
    """Load a checkpoint written by `save` into `models` (any TP/PP layout) and `optimizer` (if given); strict.

    Returns the trainer state dict. Collective.
    """
    problem = verify(path)
    if problem:
        raise CheckpointError(problem)
    _load_strict(os.path.join(path, "model"), models)
    if optimizer is not None:
        _read(os.path.join(path, "optim"), optimizer.load, os.path.join(path, "optim"), _model_sharded_state(models))
    rng_file = os.path.join(path, "rng", f"rank_{_rank()}.pt")
    if restore_rng and os.path.isfile(rng_file):
        set_rng_state(_read(rng_file, lambda: torch.load(rng_file, weights_only=True)))
    return read_state(path)


def _read(what: str, fn, *args):
    """Run a megatron/torch checkpoint read; a failure becomes CheckpointError naming `what`."""
    try:
        return fn(*args)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure means the same thing to the user
        raise CheckpointError(
            f"cannot read {what}: {type(exc).__name__}: {str(exc)[:300]} (a damaged or truncated file, or a "
            "checkpoint of another model shape)"
        ) from exc


def model_dir(path: str) -> str:
    """The model part of a checkpoint: `<path>/model` of a job checkpoint, or `<path>` itself (a converted model)."""
    return os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path


def stored_shapes(path: str) -> dict[str, tuple]:
    """{tensor name: global shape} of the model stored at `path` (from the metadata alone)."""
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return {
        k: tuple(v.global_shape)
        for k, v in load_tensors_metadata(_existing_model_dir(path)).items()
        if hasattr(v, "global_shape") and not k.endswith("_extra_state")
    }


def head_kind(path: str) -> str:
    """'scalar' when the stored output layer is [1, hidden] (a reward model or critic), else 'lm' (a policy: an LM
    head [V, hidden], or none when the embeddings are tied)."""
    shape = stored_shapes(path).get("output_layer.weight")
    return "scalar" if shape is not None and shape[0] == 1 else "lm"


def load_model_weights(path: str, models, vocab_size: int | None = None) -> None:
    """Load only the model weights (e.g. a converted HF checkpoint: `<path>/model` or `<path>` itself); strict.

    `vocab_size` (the real, unpadded vocabulary), when given, must fit in the stored embedding rows."""
    _load_strict(_existing_model_dir(path), models, vocab_size=vocab_size)


def load_backbone_weights(path: str, models) -> None:
    """Like `load_model_weights`, but leaves the output layer as built: initialises a model whose head differs from
    the checkpoint's, e.g. a critic (scalar head) from a converted policy (LM head), as NeMo-Aligner's
    `load_base_model_only` does. The embedding, all layers and the final norm are loaded, strictly."""
    _load_strict(_existing_model_dir(path), models, skip=("output_layer.",))


def _existing_model_dir(path: str) -> str:
    directory = model_dir(path)
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise CheckpointError(
            f"{path} is not a model checkpoint (no {os.path.join(directory, 'metadata.json')}): give a job's "
            "checkpoint directory (step_*) or one written by scripts/convert_hf_to_nemo.py"
        )
    return directory


def _expected_tensors(models, skip: tuple[str, ...]) -> dict[str, tuple[tuple, bool]]:
    """{checkpoint key: (global shape, rows may differ)} of the tensors `models` hold on this rank."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    sharded = _model_sharded_state(models)
    apply_factories(sharded)  # a gated fc1 is a factory of two tensors: its real keys and shapes
    out = {}
    for v in nested_values(sharded):
        if isinstance(v, ShardedTensor) and not v.key.endswith("_extra_state") and not v.key.startswith(skip):
            out[v.key] = (tuple(v.global_shape), bool(v.allow_shape_mismatch))
    return out


def check_matches(
    path: str, models, skip: tuple[str, ...] = (), vocab_size: int | None = None, described_by: str = "the config"
) -> None:
    """Raise CheckpointMismatchError (on every rank alike; collective) unless the dist checkpoint at `path` stores
    exactly the tensors `models` hold, with their global shapes; keys starting with `skip` are left out of both."""
    expected = _expected_tensors(models, skip)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, expected)
        expected = {k: v for part in gathered for k, v in part.items()}
    stored = {k: v for k, v in _read(path, stored_shapes, path).items() if not k.startswith(skip)}
    problems = []  # (key, what is wrong)
    for key in sorted(set(expected) - set(stored)):
        problems.append((key, f"{key} is missing from the checkpoint"))
    for key in sorted(set(stored) - set(expected)):
        problems.append((key, f"the checkpoint has {key}, which {described_by} has no place for"))
    for key in sorted(set(expected) & set(stored)):
        (want, rows_may_differ), have = expected[key], stored[key]
        if rows_may_differ and len(have) == len(want) and have[1:] == want[1:]:
            if vocab_size is not None and want[0] > 1 and have[0] < vocab_size:
                problems.append((key, f"{key} stores {have[0]} rows but {described_by} has vocab_size={vocab_size}"))
            continue
        if have != want:
            problems.append((key, f"{key}: the checkpoint stores shape {have} but {described_by} implies {want}"))
    if problems:
        hints = sorted({hint for key, _ in problems for part, hint in _HINTS if part in key})
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointMismatchError(
            f"{model_dir(path)} does not match the model {described_by} describes: "
            + "; ".join(text for _, text in problems[:3])
            + more
            + (f"; check {'; '.join(hints)}" if hints else "")
        )


@torch.no_grad()
def _load_strict(directory: str, models, skip: tuple[str, ...] = (), vocab_size: int | None = None) -> None:
    from megatron.core import dist_checkpointing

    check_matches(directory, models, skip=skip, vocab_size=vocab_size)
    sharded = [_without(m.sharded_state_dict(), skip) for m in models]
    if len(models) == 1:
        loaded = [_read(directory, dist_checkpointing.load, sharded[0], directory)]
    else:
        both = _read(directory, dist_checkpointing.load, {f"model{i}": s for i, s in enumerate(sharded)}, directory)
        loaded = [both[f"model{i}"] for i in range(len(models))]
    for m, state in zip(models, loaded):
        result = m.load_state_dict(state, strict=False)
        # Transformer Engine's _extra_state may be absent (a checkpoint from the local spec): the only allowed gap.
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state") and not k.startswith(skip)]
        if missing or result.unexpected_keys:
            raise CheckpointMismatchError(
                f"{directory}: loading left {missing[:4]} unfilled and {result.unexpected_keys[:4]} unused"
            )


def _without(state: dict, skip: tuple[str, ...]) -> dict:
    return {k: v for k, v in state.items() if not k.startswith(skip)} if skip else state
