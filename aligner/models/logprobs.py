"""Log-probs of given tokens and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary: `logits_BTv` with v = V_padded / TP.
The softmax normaliser is assembled with two all-reduces over the TP group (max, then sum of exp); the target
token's logit comes from the one rank that owns it (an all-reduce of a masked gather). Columns at or past
`vocab_size` (megatron's padding) are masked to -inf, so they carry no probability and no gradient.
Temperature divides the logits before the softmax, exactly as the sampler does.

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


def _masked_scaled(logits_BTv, temperature, vocab_size, rank, world):
    """Temperature-scaled float32 logits with vocabulary padding set to -inf; also the slice's start index."""
    local_v = logits_BTv.shape[-1]
    start = rank * local_v
    logits = logits_BTv.float()
    if temperature != 1.0:
        logits = logits / temperature
    if vocab_size is not None and start + local_v > vocab_size:
        pad = torch.arange(start, start + local_v, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    return logits, start


class _VocabParallelLogProbs(torch.autograd.Function):
    """Returns (logp of targets, entropy), both [B, T]; backward is exact and purely local after the forward's
    reductions (softmax of the slice minus one-hot of the owned target)."""

    @staticmethod
    def forward(ctx, logits, targets, group, world, rank, start):
        local_v = logits.shape[-1]
        max_local = logits.max(dim=-1).values
        max_global = max_local.clone()
        if world > 1:
            dist.all_reduce(max_global, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_global.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        # sum p*shifted for the entropy: H = log Z - sum p * shifted, with Z = sum exp(shifted)
        sum_exp_shifted = (exp * torch.where(torch.isinf(shifted), 0.0, shifted)).sum(-1)
        owned = (targets >= start) & (targets < start + local_v)
        local_idx = (targets - start).clamp(0, local_v - 1)
        # where, not multiply: a slice that is all padding holds -inf, and -inf * 0 is nan
        target_shifted = torch.where(owned, shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1), 0.0)
        stats = torch.stack([sum_exp, sum_exp_shifted, target_shifted])
        if world > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_shifted, target_shifted = stats
        log_z = sum_exp.log()
        logp = target_shifted - log_z
        probs_mean_shifted = sum_exp_shifted / sum_exp
        entropy = log_z - probs_mean_shifted
        probs = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(probs, shifted, owned, local_idx, log_z, probs_mean_shifted)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        probs, shifted, owned, local_idx, log_z, mean_shifted = ctx.saved_tensors
        grad = torch.zeros_like(probs)
        if grad_logp is not None:
            grad = grad - probs * grad_logp.unsqueeze(-1)
            onehot = torch.zeros_like(probs).scatter_(-1, local_idx.unsqueeze(-1), 1.0) * owned.unsqueeze(-1)
            grad = grad + onehot * grad_logp.unsqueeze(-1)
        if grad_entropy is not None:
            # dH/dz_i = -p_i (z_i - sum_j p_j z_j), z the shifted logits (the shift cancels).
            finite_shifted = torch.where(torch.isinf(shifted), 0.0, shifted)
            grad = grad - probs * (finite_shifted - mean_shifted.unsqueeze(-1)) * grad_entropy.unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_logprobs(
    logits_BTv,
    targets_BT,
    tp_group=None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    with_entropy: bool = False,
):
    """Log-prob of `targets_BT` under softmax(logits / temperature) over the full (unpadded) vocabulary.

    logits_BTv: this TP rank's vocabulary slice (any float dtype; computed in float32).
    Returns logp_BT (float32), or (logp_BT, entropy_BT) with `with_entropy`. Differentiable w.r.t. logits.
    """
    group, world, rank = _tp_info(tp_group)
    logits, start = _masked_scaled(logits_BTv, temperature, vocab_size, rank, world)
    logp, entropy = _VocabParallelLogProbs.apply(logits, targets_BT.long(), group, world, rank, start)
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
