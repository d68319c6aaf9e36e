"""Micro-batches for the supervised trainers: sequence packing and length bucketing (pure torch, no model).

Packing (SFT): `pack(lengths, capacity)` groups samples into rows of at most `capacity` tokens (first-fit
decreasing). `packed_rows(samples, capacity)` lays them out: one row holds several samples back to back, with
  - `position_ids` restarting at 0 for each sample (learned position embeddings read them; RoPE is relative, so a
    sample's attention scores depend only on distances inside it, whatever its offset in the row),
  - `segment_ids` (0, 1, ... per sample; the padding after the last sample, -1, is a segment of its own), which
    keep attention inside each sample in one of two forms: `attention_mask`, megatron's convention, bool
    [B, 1, T, T], True = masked (any attention core reads it), or `segment_starts`: where each sample starts in the
    flattened rows, for a variable-length attention kernel that computes only the samples' own causal blocks
    (aligner.models.attention.Segments; the SFT trainer's `data.packed_attention`).
Together they make each sample's logits those of the sample alone (tests/unit/test_packing.py).
Bucketing: `length_buckets(lengths, size)` sorts examples by length before cutting micro-batches, so each is padded
only to its own longest member.

Row layout of a micro-batch dict: `tokens` [B, T] (pad id after the end), `targets` [B, T] bool (token t is trained
on; never the first token of a sample, which nothing before it in its sample predicts), and for packed rows
`position_ids` [B, T], `segment_ids` [B, T] and (unless `collate(..., mask=False)`) `attention_mask` [B, 1, T, T].
`collate(..., device)` moves all but `segment_ids` to the device: the ids stay on the CPU, where the samples' starts
are found without waiting for the GPU (a read-back per micro-batch would stall the host's queue of launches).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of total length <= `capacity` (first-fit decreasing; deterministic:
    ties keep their order). Every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a sample of {n} tokens does not fit in rows of {capacity}")
        for b, free in enumerate(room):
            if n <= free:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(capacity - n)
    return bins


def length_buckets(lengths: Sequence[int], size: int) -> list[list[int]]:
    """Indices sorted by length (longest first, ties in order), cut into groups of `size` (the last may be smaller)."""
    order = longest_first(lengths)
    return [order[i : i + size] for i in range(0, len(order), size)]


def longest_first(lengths: Sequence[int]) -> list[int]:
    """Indices of `lengths`, longest first (ties in their order)."""
    return sorted(range(len(lengths)), key=lambda i: -lengths[i])


def trimmed_groups(
    lengths: Sequence[int], size: int, trim: int, width: int, max_tokens: int | None = None
) -> list[tuple[list[int], int]]:
    """Micro-batches of indices into `lengths`, each with the width it runs at. `trim` 0: in order, each at `width`;
    `trim` > 0: longest first (ties in order), each cut to its longest row rounded up to a multiple of `trim` tokens
    (at most `width`). Right padding changes no causal output, so the cut rows compute the same. `size` rows a
    micro-batch, or with `max_tokens` as many rows as fit in that many tokens at the micro-batch's width (at least
    one): short rows go in large micro-batches, long rows in small ones."""

    def cut(n: int) -> int:
        return min(width, -(-n // trim) * trim) if trim else width

    order = longest_first(lengths) if trim else list(range(len(lengths)))
    groups, lo = [], 0
    while lo < len(order):
        count = size if max_tokens is None else max(1, max_tokens // cut(lengths[order[lo]]))
        group = order[lo : lo + count]
        groups.append((group, cut(max(lengths[i] for i in group))))
        lo += count
    return groups


def packed_row(samples: Sequence) -> dict[str, np.ndarray]:
    """One row from `samples` (each with `.ids` and `.targets`): ids, targets, position ids, segment ids (unpadded)."""
    return {
        "tokens": np.concatenate([s.ids for s in samples]),
        "targets": np.concatenate([s.targets for s in samples]),
        "position_ids": np.concatenate([np.arange(len(s.ids)) for s in samples]),
        "segment_ids": np.concatenate([np.full(len(s.ids), k) for k, s in enumerate(samples)]),
    }


def plain_row(sample) -> dict[str, np.ndarray]:
    return {"tokens": sample.ids, "targets": sample.targets}


def attention_mask_from_segments(segment_ids_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, 1, T, T], True where query i may NOT attend to key j: j > i, or another segment."""
    T = segment_ids_BT.shape[1]
    future_TT = torch.ones(T, T, dtype=torch.bool, device=segment_ids_BT.device).triu(1)
    other_BTT = segment_ids_BT.unsqueeze(2) != segment_ids_BT.unsqueeze(1)
    return (other_BTT | future_TT).unsqueeze(1)


def segment_starts(segment_ids_BT: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(starts, longest) of the segments of packed rows, the rows laid end to end ([B x T] tokens): `starts` int32
    [n + 1], the first token of each of the n segments and then B x T (a variable-length kernel's cumulative
    lengths); a segment starts at each row's first token and wherever the id changes. `longest`: the longest
    segment's length."""
    B, T = segment_ids_BT.shape
    flat = segment_ids_BT.reshape(-1)
    first = torch.ones_like(flat, dtype=torch.bool)
    first[1:] = flat[1:] != flat[:-1]
    first[::T] = True
    starts = torch.cat([first.nonzero().squeeze(1), torch.tensor([B * T], device=flat.device)]).to(torch.int32)
    return starts, int((starts[1:] - starts[:-1]).max())


def collate(rows: Sequence[dict], width: int, pad_id: int, device=None, mask: bool = True) -> dict[str, torch.Tensor]:
    """Rows (from `packed_row` or `plain_row`) right-padded to `width` as one micro-batch (see the module docstring).
    Padding is never a target; in packed rows it is its own segment, so its (unused) attention rows are not empty.
    `mask=False`: packed rows without the dense `attention_mask` (their attention reads `segment_ids`)."""
    B = len(rows)
    tokens = torch.full((B, width), pad_id, dtype=torch.long)
    targets = torch.zeros(B, width, dtype=torch.bool)
    packed = "segment_ids" in rows[0]
    if packed:
        positions = torch.zeros(B, width, dtype=torch.long)
        segments = torch.full((B, width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row["tokens"])
        if n > width:
            raise ValueError(f"a row of {n} tokens does not fit in width {width}")
        tokens[b, :n] = torch.from_numpy(np.asarray(row["tokens"], dtype=np.int64))
        targets[b, :n] = torch.from_numpy(np.asarray(row["targets"], dtype=bool))
        if packed:
            positions[b, :n] = torch.from_numpy(np.asarray(row["position_ids"], dtype=np.int64))
            positions[b, n:] = torch.arange(width - n)
            segments[b, :n] = torch.from_numpy(np.asarray(row["segment_ids"], dtype=np.int64))
    out = {"tokens": tokens, "targets": targets}
    if packed:
        out["position_ids"] = positions
        out["segment_ids"] = segments
        if mask:
            out["attention_mask"] = attention_mask_from_segments(segments)
    if device is not None:  # the segment ids stay on the CPU (the module docstring)
        out = {k: v if k == "segment_ids" else v.to(device) for k, v in out.items()}
    return out


def collate_pairs(pairs: Sequence, width: int, pad_id: int, device=None) -> dict[str, torch.Tensor]:
    """Preference pairs (each with `.chosen`, `.rejected`, `.prompt_length`) as one micro-batch of 2m rows: the m
    chosen sequences first, then the m rejected ones, right-padded to `width`. `targets` marks the response tokens
    (after the shared prompt), `lengths` [2m] the sequence lengths (a reward model reads position length - 1)."""
    rows = []
    for seqs in ([p.chosen for p in pairs], [p.rejected for p in pairs]):
        for p, ids in zip(pairs, seqs, strict=True):
            targets = np.zeros(len(ids), dtype=bool)
            targets[p.prompt_length :] = True
            rows.append({"tokens": ids, "targets": targets})
    out = collate(rows, width, pad_id)
    out["lengths"] = torch.tensor([len(r["tokens"]) for r in rows], dtype=torch.long)
    if device is not None:
        out = {k: v.to(device) for k, v in out.items()}
    return out
