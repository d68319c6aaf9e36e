"""The critic job's wire contract: endpoint names, tensor names/dtypes/shapes, and request validation.

Shared by the server (which validates every request before it reaches the models) and the client (which
validates before sending, so a bad batch fails at the call site). Pure numpy; imports nothing heavy.

Endpoints (Triton models without server-side batching: every shape below includes the batch dimension B):
- `critic_infer`  in: tokens int64 [B, T] (right-padded), lengths int64 [B, 1], optional prompt_lengths int64 [B, 1],
                  optional labels BYTES [B, 1] (passed to a reward function; ignored by a reward model)
                  out: values float32 [B, T] (the critic at each position, 0 at positions >= length),
                  rewards float32 [B, 1]
- `critic_train`  in: tokens, lengths, returns float32 [B, T], prev_values float32 [B, T], mask float32 [B, T]
                  out: one float32 [1] tensor per name in TRAIN_METRICS
- `critic_save`   in: step int64 [1], run_id BYTES [1]; out: path BYTES [1] (the checkpoint directory written)
- `critic_resume` in: step int64 [1] (-1: a fresh run), run_id BYTES [1]; out: path BYTES [1] (the checkpoint
                  loaded; empty for a fresh run). Sent once by the actor before anything else of a run (see
                  aligner.checkpoint.run and CriticService.resume).
Every request carries the run's shared secret as the request parameter `token` when the critic job has one
(always when it listens on an address other machines can reach): see aligner.critic.auth.
Labels are at most LABEL_MAX_BYTES each (UTF-8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

INFER, TRAIN, SAVE, RESUME = "critic_infer", "critic_train", "critic_save", "critic_resume"
ENDPOINTS = (INFER, TRAIN, SAVE, RESUME)
LABEL_MAX_BYTES = 65536
_RUN_ID = re.compile(r"^[0-9a-f]{1,64}$")
TRAIN_METRICS = (
    "loss",
    "value_clipfrac",
    "grad_norm",
    "explained_variance",
    "value_mean",
    "tokens",
    "steps",
    "skipped_steps",
    "lr",
)


class CriticRequestError(ValueError):
    """A malformed request: the message names the tensor, the problem and the fix."""


class CriticCheckpointError(CriticRequestError):
    """A critic_save or critic_resume the critic cannot honour (wrong run or step, missing or damaged checkpoint)."""


@dataclass(frozen=True)
class Limits:
    max_batch_size: int
    max_seq_len: int
    vocab_size: int
    max_train_batch_size: int | None = None


def _as_array(name: str, x, dtype) -> np.ndarray:
    if x is None:
        raise CriticRequestError(f"{name} is missing")
    if hasattr(x, "detach"):  # a torch tensor, on any device
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if dtype is not None and arr.dtype != dtype:
        if dtype == np.int64:  # any integer type converts; floats and bools would hide a bug
            ok = np.issubdtype(arr.dtype, np.integer)
        else:
            ok = np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
        if not ok:
            raise CriticRequestError(f"{name} has dtype {arr.dtype}; send {np.dtype(dtype).name}")
        arr = arr.astype(dtype)
    return arr


def _column(name: str, x, batch: int) -> np.ndarray:
    """[B] or [B, 1] -> [B] int64."""
    arr = _as_array(name, x, np.int64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise CriticRequestError(f"{name} has shape {list(arr.shape)}; send [B, 1] (one integer per row)")
    if arr.shape[0] != batch:
        raise CriticRequestError(f"{name} has {arr.shape[0]} rows but tokens has {batch}: one entry per sequence")
    return arr


def check_tokens(tokens, lengths, limits: Limits, max_rows: int, max_rows_key: str) -> tuple[np.ndarray, np.ndarray]:
    """Validate tokens [B, T] and lengths [B] / [B, 1]; returns (tokens int64 [B, T], lengths int64 [B])."""
    tokens = _as_array("tokens", tokens, np.int64)
    if tokens.ndim != 2:
        raise CriticRequestError(f"tokens has shape {list(tokens.shape)}; send [B, T] (right-padded token ids)")
    batch, seq = tokens.shape
    if batch == 0:
        raise CriticRequestError("empty batch: tokens has 0 rows; send at least one sequence")
    if batch > max_rows:
        raise CriticRequestError(
            f"batch of {batch} rows exceeds {max_rows_key}={max_rows}: split the request "
            f"or raise {max_rows_key} in the critic job's config"
        )
    if seq == 0 or seq > limits.max_seq_len:
        raise CriticRequestError(f"tokens has {seq} columns; must be 1..{limits.max_seq_len} (server.max_seq_len)")
    lengths = _column("lengths", lengths, batch)
    bad = np.flatnonzero((lengths < 1) | (lengths > seq))
    if bad.size:
        i = int(bad[0])
        raise CriticRequestError(
            f"lengths[{i}]={int(lengths[i])} is outside 1..T={seq}: each length counts the "
            f"valid tokens of its row (prompt + response) and cannot exceed the padded width"
        )
    valid = np.arange(seq)[None, :] < lengths[:, None]
    bad_tok = valid & ((tokens < 0) | (tokens >= limits.vocab_size))
    if bad_tok.any():
        i, j = (int(v) for v in np.argwhere(bad_tok)[0])
        raise CriticRequestError(
            f"tokens[{i}, {j}]={int(tokens[i, j])} is outside the vocabulary 0..."
            f"{limits.vocab_size - 1}: was the batch tokenized with the critic's tokenizer?"
        )
    return tokens, lengths


def check_infer(tokens, lengths, prompt_lengths, labels, limits: Limits):
    """Validate a critic_infer request; returns (tokens [B, T], lengths [B], prompt_lengths [B] | None,
    labels list[str | None] | None)."""
    tokens, lengths = check_tokens(tokens, lengths, limits, limits.max_batch_size, "server.max_batch_size")
    batch = tokens.shape[0]
    if prompt_lengths is not None:
        prompt_lengths = _column("prompt_lengths", prompt_lengths, batch)
        bad = np.flatnonzero((prompt_lengths < 0) | (prompt_lengths > lengths))
        if bad.size:
            i = int(bad[0])
            raise CriticRequestError(
                f"prompt_lengths[{i}]={int(prompt_lengths[i])} is outside 0..lengths[{i}]="
                f"{int(lengths[i])}: the prompt is a prefix of the sequence"
            )
    if labels is not None:
        labels = decode_labels(labels, batch)
    return tokens, lengths, prompt_lengths, labels


def decode_labels(labels, batch: int) -> list:
    """BYTES [B, 1] (or a list of str/bytes/None) -> list of B strings, empty labels as None."""
    if isinstance(labels, (list, tuple)):
        items = list(labels)
    else:
        arr = np.asarray(labels, dtype=object)
        if arr.ndim == 2 and arr.shape[1] == 1:
            arr = arr[:, 0]
        if arr.ndim != 1:
            raise CriticRequestError(f"labels has shape {list(arr.shape)}; send [B, 1] (one string per row)")
        items = arr.tolist()
    if len(items) != batch:
        raise CriticRequestError(f"labels has {len(items)} rows but tokens has {batch}: one label per sequence")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, bytes):
            if len(item) > LABEL_MAX_BYTES:
                raise CriticRequestError(f"labels[{i}] has {len(item)} bytes; at most {LABEL_MAX_BYTES} are accepted")
            try:
                item = item.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CriticRequestError(f"labels[{i}] is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        elif isinstance(item, str) and len(item.encode("utf-8")) > LABEL_MAX_BYTES:
            raise CriticRequestError(f"labels[{i}] is longer than {LABEL_MAX_BYTES} bytes")
        out.append(None if item is None or item == "" else str(item))
    return out


def check_train(tokens, lengths, returns, prev_values, mask, limits: Limits):
    """Validate a critic_train request; returns numpy (tokens, lengths [B], returns, prev_values, mask) with the
    float tensors [B, T] float32."""
    max_rows = limits.max_train_batch_size or limits.max_batch_size
    tokens, lengths = check_tokens(tokens, lengths, limits, max_rows, "server.max_train_batch_size")
    shape = tokens.shape
    floats = {}
    for name, x in (("returns", returns), ("prev_values", prev_values), ("mask", mask)):
        arr = _as_array(name, x, np.float32)
        if arr.shape != shape:
            raise CriticRequestError(
                f"{name} has shape {list(arr.shape)} but tokens has {list(shape)}: send one value per token position"
            )
        floats[name] = arr
    mask = floats["mask"]
    if not np.isin(mask, (0.0, 1.0)).all():
        raise CriticRequestError("mask must hold only 0 and 1 (1 on the response tokens the value loss covers)")
    beyond = (mask != 0) & (np.arange(shape[1])[None, :] >= lengths[:, None])
    if beyond.any():
        i, j = (int(v) for v in np.argwhere(beyond)[0])
        raise CriticRequestError(
            f"mask[{i}, {j}] is 1 but lengths[{i}]={int(lengths[i])}: the mask may cover only "
            f"positions inside the sequence"
        )
    for name in ("returns", "prev_values"):
        bad = (mask != 0) & ~np.isfinite(floats[name])
        if bad.any():
            i, j = (int(v) for v in np.argwhere(bad)[0])
            raise CriticRequestError(
                f"{name}[{i}, {j}] is {floats[name][i, j]} at a masked-in position: "
                f"values under the mask must be finite"
            )
    return tokens, lengths, floats["returns"], floats["prev_values"], mask


def check_step(step, allow_fresh: bool = False) -> int:
    """One non-negative integer (or -1, "a fresh run", with `allow_fresh`)."""
    arr = _as_array("step", step, np.int64).reshape(-1)
    low = -1 if allow_fresh else 0
    if arr.size != 1 or not low <= int(arr[0]) < 2**40:
        raise CriticRequestError(f"step must be one integer in {low}..2^40, got {arr.tolist()[:4]}")
    return int(arr[0])


def check_run_id(run_id) -> str:
    """A run id (lower-case hex, as aligner.checkpoint.run.new_run_id makes); BYTES [1], bytes or str."""
    if isinstance(run_id, (np.ndarray, list, tuple)):
        flat = np.asarray(run_id, dtype=object).reshape(-1)
        run_id = flat[0] if flat.size == 1 else None
    if isinstance(run_id, bytes):
        run_id = run_id.decode("ascii", errors="replace")
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise CriticRequestError("run_id must be one lower-case hex string (the actor's run id)")
    return run_id
