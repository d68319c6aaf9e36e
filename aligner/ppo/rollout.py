"""Rollout batches: prompts + generated responses laid out as right-padded sequences, and their masks.

Alignment (the one convention of the actor loop): a sequence is `tokens_BT`, prompt in [0, p_b), response in
[p_b, p_b + r_b). Every per-token quantity (log-probs, values, rewards, advantages, masks) lives on the *shifted*
grid [B, T-1]: index i is about token i+1 as predicted from the prefix tokens[:i+1]. So the response token j of
sample b sits at shifted index p_b - 1 + j, and `mask_BS` is 1 exactly there. The critic answers values on the
[B, T] grid of positions (value at position i = critic's output at i, the state tokens[:i+1]); `values[:, :-1]`
is therefore the value of the state before each token, on the shifted grid.

Micro-batches (`micro_batches`): rows of the rollout with their per-token tensors, optionally sorted by length and
cut to their own longest row (right padding after a row changes none of its causal outputs); `by_row` puts their
results back in rollout order.

Groups: with n samples per prompt, sample j of prompt g sits at position g * n + j of the step's global batch, so a
prompt's samples are consecutive rows; the layout functions deal out whole groups (`expand_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aligner.data.packing import trimmed_groups


@dataclass
class Rollout:
    tokens_BT: torch.Tensor  # int64, right-padded with pad_id
    lengths_B: torch.Tensor  # prompt + response
    prompt_lengths_B: torch.Tensor
    response_lengths_B: torch.Tensor
    ended_B: torch.Tensor  # bool: ended by EOS/stop token (False: cut at the length limit)
    engine_logp_BS: torch.Tensor  # float32 on the shifted grid, 0 off the response
    mask_BS: torch.Tensor  # float32 on the shifted grid
    labels: list = field(default_factory=list)
    positions: list = field(default_factory=list)  # each row's position in the step's global batch

    @property
    def batch_size(self) -> int:
        return self.tokens_BT.shape[0]


def response_mask(prompt_lengths_B: torch.Tensor, response_lengths_B: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] float mask of the response tokens on the shifted grid."""
    idx_S = torch.arange(width, device=prompt_lengths_B.device)
    start_B1 = (prompt_lengths_B - 1).unsqueeze(1)
    end_B1 = (prompt_lengths_B - 1 + response_lengths_B).unsqueeze(1)
    return ((idx_S >= start_B1) & (idx_S < end_B1)).float()


def assemble(
    prompt_tokens_BP: torch.Tensor,
    prompt_lengths_B: torch.Tensor,
    response_tokens_BR: torch.Tensor,
    response_lengths_B: torch.Tensor,
    logprobs_BR: torch.Tensor,
    ended_B: torch.Tensor,
    pad_id: int,
    total_length: int,
) -> Rollout:
    """Lay prompts and responses out as sequences of `total_length` tokens (>= every p_b + r_b)."""
    B = prompt_tokens_BP.shape[0]
    device = prompt_tokens_BP.device
    lengths_B = prompt_lengths_B + response_lengths_B
    if int(lengths_B.max()) > total_length:
        raise ValueError(f"a sequence of {int(lengths_B.max())} tokens does not fit in {total_length}")
    tokens_BT = torch.full((B, total_length), pad_id, dtype=torch.long, device=device)
    engine_logp_BS = torch.zeros(B, total_length - 1, dtype=torch.float32, device=device)
    for b in range(B):
        p, r = int(prompt_lengths_B[b]), int(response_lengths_B[b])
        tokens_BT[b, :p] = prompt_tokens_BP[b, :p]
        tokens_BT[b, p : p + r] = response_tokens_BR[b, :r]
        engine_logp_BS[b, p - 1 : p - 1 + r] = logprobs_BR[b, :r].float()
    mask_BS = response_mask(prompt_lengths_B, response_lengths_B, total_length - 1)
    return Rollout(
        tokens_BT,
        lengths_B,
        prompt_lengths_B.clone(),
        response_lengths_B.clone(),
        ended_B.bool(),
        engine_logp_BS,
        mask_BS,
    )


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout from several (generation chunks), padded to the longest."""
    if len(rollouts) == 1:
        return rollouts[0]
    T = max(r.tokens_BT.shape[1] for r in rollouts)

    def pad(x, width, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return Rollout(
        tokens_BT=torch.cat([pad(r.tokens_BT, T, pad_id) for r in rollouts]),
        lengths_B=torch.cat([r.lengths_B for r in rollouts]),
        prompt_lengths_B=torch.cat([r.prompt_lengths_B for r in rollouts]),
        response_lengths_B=torch.cat([r.response_lengths_B for r in rollouts]),
        ended_B=torch.cat([r.ended_B for r in rollouts]),
        engine_logp_BS=torch.cat([pad(r.engine_logp_BS, T - 1, 0.0) for r in rollouts]),
        mask_BS=torch.cat([pad(r.mask_BS, T - 1, 0.0) for r in rollouts]),
        labels=[x for r in rollouts for x in r.labels],
        positions=[x for r in rollouts for x in r.positions],
    )


def pad_to(rollout: Rollout, total_length: int, pad_id: int) -> Rollout:
    T = rollout.tokens_BT.shape[1]
    if T == total_length:
        return rollout
    extra = total_length - T
    rollout.tokens_BT = torch.nn.functional.pad(rollout.tokens_BT, (0, extra), value=pad_id)
    rollout.engine_logp_BS = torch.nn.functional.pad(rollout.engine_logp_BS, (0, extra))
    rollout.mask_BS = torch.nn.functional.pad(rollout.mask_BS, (0, extra))
    return rollout


def minibatch_positions(n: int, groups: int, dp: int, dp_rank: int, seed: int | None) -> list[int]:
    """Positions in a global batch of `n` that DP rank `dp_rank` owns, mini-batch by mini-batch.

    The global batch is permuted once (the same `seed` on every rank; None = no permutation) and cut into `groups`
    global mini-batches; each DP rank takes its contiguous share of every one. So local rows
    [m * n / (groups * dp), (m + 1) * n / (groups * dp)) are this rank's share of global mini-batch m, and the
    mini-batches are the same sets of samples for any DP size (DP=2 reproduces DP=1).
    """
    if seed is None:
        order = list(range(n))
    else:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    per_group = n // groups
    share = per_group // dp
    mine = []
    for m in range(groups):
        lo = m * per_group + dp_rank * share
        mine.extend(order[lo : lo + share])
    return mine


def expand_groups(group_positions: list[int], group_size: int) -> list[int]:
    """Sample positions of the groups at `group_positions` (each group's `group_size` samples, in order)."""
    return [g * group_size + j for g in group_positions for j in range(group_size)]


def select_rows(rollout: Rollout, rows: list[int], device=None) -> Rollout:
    """A rollout of `rows` of `rollout` (same sequence width), on `device` (default: where it is)."""
    idx = torch.tensor(rows, dtype=torch.long, device=rollout.tokens_BT.device)

    def take(x):
        return x[idx].to(device) if device is not None else x[idx]

    return Rollout(
        tokens_BT=take(rollout.tokens_BT),
        lengths_B=take(rollout.lengths_B),
        prompt_lengths_B=take(rollout.prompt_lengths_B),
        response_lengths_B=take(rollout.response_lengths_B),
        ended_B=take(rollout.ended_B),
        engine_logp_BS=take(rollout.engine_logp_BS),
        mask_BS=take(rollout.mask_BS),
        labels=[rollout.labels[r] for r in rows] if rollout.labels else [],
        positions=[rollout.positions[r] for r in rows] if rollout.positions else [],
    )


def gather_rollout(rollout: Rollout, scores_B: torch.Tensor, group, pad_id: int) -> tuple[Rollout, torch.Tensor]:
    """The whole global batch on every rank of `group` (on the CPU, rows in global-position order) with its scores.

    Collective over `group` (None: this rank's rows only). Token ids and a few floats per token: small next to a
    forward pass; used where the rows must be dealt out again (dynamic sampling keeps a subset of the groups).
    """
    import torch.distributed as dist

    def cpu(r: Rollout) -> Rollout:
        return select_rows(r, list(range(r.batch_size)), device="cpu")

    mine = (cpu(rollout), scores_B.detach().cpu())
    if group is None or dist.get_world_size(group) == 1:
        parts = [mine]
    else:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
    whole = concat([r for r, _ in parts], pad_id)
    scores = torch.cat([sc for _, sc in parts])
    order = sorted(range(whole.batch_size), key=lambda i: whole.positions[i])
    return select_rows(whole, order), scores[order]


def sample_seeds(base_seed: int, step: int, indices: list[int]) -> list[int]:
    """Per-sample sampling seeds that depend only on (seed, step, position in the global batch): a resumed run or
    another data-parallel layout draws the same responses."""
    return [(base_seed * 1_000_003 + step * 65_537 + i * 7919) % (2**31 - 1) for i in indices]


def micro_batches(
    rollout: Rollout, rows: list[int] | None, size: int, trim: int = 0, max_tokens: int | None = None, **per_token
) -> list[dict]:
    """Micro-batches of `size` of `rows` (None: all, in order): `tokens`, `mask`, `ended`, `rows` (the rollout rows
    it holds, a tensor) and each `per_token` [B, T-1] tensor. `trim` > 0: the rows go longest first (ties in order)
    and each micro-batch is cut to its longest row rounded up to a multiple of `trim` tokens (at most T).
    `max_tokens`: as many rows a micro-batch as fit in that many tokens at its width, instead of `size`
    (data.packing.trimmed_groups)."""
    rows = list(range(rollout.batch_size)) if rows is None else list(rows)
    lengths = rollout.lengths_B.tolist()
    out = []
    T = rollout.tokens_BT.shape[1]
    for group, width in trimmed_groups([lengths[r] for r in rows], size, trim, T, max_tokens):
        chunk = [rows[i] for i in group]
        idx = torch.tensor(chunk, device=rollout.tokens_BT.device)
        mb = {
            "tokens": rollout.tokens_BT[idx, :width],
            "mask": rollout.mask_BS[idx, : width - 1],
            "ended": rollout.ended_B[idx],
            "rows": idx,
        }
        mb.update({k: v[idx, : width - 1] for k, v in per_token.items()})
        out.append(mb)
    return out


def by_row(micro: list[dict], parts: list[torch.Tensor], rows: int, width: int) -> torch.Tensor:
    """[rows, width] from per-micro-batch results [mb, w <= width] in rollout order (zeros past a micro-batch's w)."""
    out = parts[0].new_zeros(rows, width)
    for mb, part in zip(micro, parts, strict=True):
        out[mb["rows"], : part.shape[1]] = part
    return out
