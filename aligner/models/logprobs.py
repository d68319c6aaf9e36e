"""Log-probs of given tokens and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary: `logits_BTv` with v = V_padded / TP.
The softmax normaliser is assembled with two all-reduces over the TP group (max, then sum of exp); the target
token's logit comes from the one rank that owns it (an all-reduce of a masked gather). Columns at or past
`vocab_size` (megatron's padding) are masked to -inf, so they carry no probability and no gradient.
Temperature divides the logits before the softmax, exactly as the sampler does.
Memory: the logits are read in row chunks (CHUNK_ELEMENTS float32 values at a time) in the forward and again in
the backward, which recomputes the probabilities; nothing of the float32 [tokens, vocabulary] size is kept for
backward (it was two such tensors: ~1 GB per 8k tokens of a 32k vocabulary, 4 GB at a 128k one).

Alignment: callers pass logits of positions 0..T-2 and targets = tokens 1..T-1 (the log-prob of token t+1 comes
from position t); `shift_for_next_token` does that slicing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_info(group):
    if group is None or not dist.is_initialized():
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


# Rows of logits turned into float32 at a time: 2^26 elements (256 MiB) per pass, whatever the vocabulary and
# micro-batch. The float32 softmax over the whole [tokens, vocabulary] block is never held.
CHUNK_ELEMENTS = 1 << 26


def _scaled_chunk(logits_Nv, temperature, pad_v):
    """float32 logits of some rows, divided by the temperature, vocabulary padding at -inf."""
    z = logits_Nv.float()
    if temperature != 1.0:
        z = z / temperature
    return z if pad_v is None else z.masked_fill(pad_v, float("-inf"))


def _chunks(B: int, T: int, width: int, chunk_elements: int) -> list[tuple[slice, slice]]:
    """(samples, positions) index pairs covering [B, T], each at most ~chunk_elements x width values: whole samples
    where they fit (slicing the first dimension never copies, also for the shifted, non-contiguous logits)."""
    rows = max(1, chunk_elements // max(1, width))
    if T <= rows:
        step = rows // T
        return [(slice(b, min(B, b + step)), slice(0, T)) for b in range(0, B, step)]
    return [(slice(b, b + 1), slice(t, min(T, t + rows))) for b in range(B) for t in range(0, T, rows)]


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logp of targets, entropy), both [B, T] float32, from this rank's [B, T, v] logit slice, in chunks.

    Forward: pass 1, each position's max over the slice (all-reduced MAX over TP); pass 2, per position
    sum exp(z - max), sum exp(z - max) * (z - max) and the target's z - max on the rank that owns it (one all-reduce
    of the three). Saved for backward: the logits themselves (already alive as the model's output) and
    per-position statistics. Backward recomputes each chunk's probabilities and writes d/dlogits in the logits'
    dtype: p * (-g_logp - g_ent * (z - mean)) + onehot * g_logp, over the temperature (the shift cancels)."""

    @staticmethod
    def forward(ctx, logits, targets, group, world, start, temperature, vocab_size, chunk_elements):
        B, T, local_v = logits.shape
        dev = logits.device
        pad_v = None
        if vocab_size is not None and start + local_v > vocab_size:
            pad_v = torch.arange(start, start + local_v, device=dev) >= vocab_size
        chunks = _chunks(B, T, local_v, chunk_elements)
        max_BT = torch.empty(B, T, dtype=torch.float32, device=dev)
        for c in chunks:  # in the logits' own dtype: max commutes with the (exact) cast and the division by T > 0
            chunk = logits[c] if pad_v is None else logits[c].masked_fill(pad_v, float("-inf"))
            max_BT[c] = chunk.amax(dim=-1).float()
        if temperature != 1.0:
            max_BT /= temperature
        if world > 1:
            dist.all_reduce(max_BT, op=dist.ReduceOp.MAX, group=group)
        owned = (targets >= start) & (targets < start + local_v)
        idx = (targets - start).clamp(0, local_v - 1)
        stats = torch.zeros(3, B, T, dtype=torch.float32, device=dev)  # sum_exp, sum_exp_shifted, target
        for c in chunks:
            shifted = _scaled_chunk(logits[c], temperature, pad_v) - max_BT[c].unsqueeze(-1)
            exp = shifted.exp()
            stats[(0, *c)] = exp.sum(-1)
            # H = log Z - sum p * shifted; padding (-inf, weight 0) contributes 0, not nan
            stats[(1, *c)] = (exp * torch.where(torch.isinf(shifted), 0.0, shifted)).sum(-1)
            # where, not multiply: a slice that is all padding holds -inf, and -inf * 0 is nan
            target = shifted.gather(-1, idx[c].unsqueeze(-1)).squeeze(-1)
            stats[(2, *c)] = torch.where(owned[c], target, 0.0)
        if world > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_shifted, target_shifted = stats
        log_z = sum_exp.log()
        logp = target_shifted - log_z
        mean_shifted = sum_exp_shifted / sum_exp
        entropy = log_z - mean_shifted
        ctx.save_for_backward(logits, owned, idx, max_BT, log_z, mean_shifted)
        ctx.pad_v, ctx.temperature, ctx.chunks = pad_v, temperature, chunks
        ctx.set_materialize_grads(False)  # an output the loss does not use (often the entropy) costs no backward work
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, owned, idx, max_BT, log_z, mean_shifted = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        grad_logits = torch.empty_like(logits)
        for c in ctx.chunks:
            shifted = _scaled_chunk(logits[c], ctx.temperature, ctx.pad_v) - max_BT[c].unsqueeze(-1)
            probs = (shifted - log_z[c].unsqueeze(-1)).exp()
            coeff = 0.0  # per element: -g_logp - g_ent * (z - mean), broadcast from [b, t, 1] where it can be
            if grad_logp is not None:
                coeff = -grad_logp[c].unsqueeze(-1)
            if grad_entropy is not None:
                # dH/dz_i = -p_i (z_i - sum_j p_j z_j), z the shifted logits
                finite = torch.where(torch.isinf(shifted), 0.0, shifted)
                coeff = coeff - grad_entropy[c].unsqueeze(-1) * (finite - mean_shifted[c].unsqueeze(-1))
            grad = probs * coeff
            if grad_logp is not None:
                hit = torch.where(owned[c], grad_logp[c], 0.0).unsqueeze(-1)
                grad = grad.scatter_add(-1, idx[c].unsqueeze(-1), hit)
            if ctx.temperature != 1.0:
                grad = grad / ctx.temperature
            grad_logits[c] = grad
        return grad_logits, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits_BTv,
    targets_BT,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
):
    """Log-prob of `targets_BT` under softmax(logits / temperature) over the full (unpadded) vocabulary.

    logits_BTv: this TP rank's vocabulary slice (any float dtype; computed in float32, about `chunk_elements`
    values at a time). Returns logp_BT (float32), or (logp_BT, entropy_BT) with `with_entropy`. Differentiable
    w.r.t. logits; the gradient comes back in the logits' dtype.
    """
    group, world, rank = _tp_info(tp_group)
    logp, entropy = _VocabParallelLogProbs.apply(
        logits_BTv,
        targets_BT.long(),
        group,
        world,
        rank * logits_BTv.shape[-1],
        float(temperature),
        vocab_size,
        chunk_elements,
    )
    return (logp, entropy) if with_entropy else logp


def shift_for_next_token(logits_BTv: torch.Tensor, tokens_BT: torch.Tensor):
    """(logits of positions 0..T-2, tokens 1..T-1): log-prob of token t+1 comes from position t."""
    return logits_BTv[:, :-1], tokens_BT[:, 1:]


def default_tp_group():
    """megatron's TP group when model parallelism is initialised, else None."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return parallel_state.get_tensor_model_parallel_group()
    return None
