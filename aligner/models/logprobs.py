"""Log-probs of given tokens and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary: `logits_BTv` with v = V_padded / TP.
The softmax normaliser is assembled with two all-reduces over the TP group (max, then sum of exp); the target
token's logit comes from the one rank that owns it (an all-reduce of a masked gather). Columns at or past
`vocab_size` (megatron's padding) are masked to -inf, so they carry no probability and no gradient.
Temperature divides the logits before the softmax, exactly as the sampler does.
Memory: the logits are read in row chunks (CHUNK_ELEMENTS float32 values at a time) in the forward and again in
the backward, which recomputes the probabilities; nothing of the float32 [tokens, vocabulary] size is kept for
backward (it was two such tensors: ~1 GB per 8k tokens of a 32k vocabulary, 4 GB at a 128k one).
Speed: `model.logprob_fusion` (`set_fusion`) runs each chunk's maths compiled into fused kernels (auto: on a GPU with
Triton), or eagerly; the two forms are one code path (docs/PERF.md: 1B training 58.3 -> 62.7 % MFU).

Alignment: callers pass logits of positions 0..T-2 and targets = tokens 1..T-1 (the log-prob of token t+1 comes
from position t); `shift_for_next_token` does that slicing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from aligner.models.compiled import CompiledOrEager
from aligner.parallel.device import triton_available


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


# The per-chunk maths: plain tensor code, run as it is (eagerly: a pass over the chunk per operation, float32
# intermediates of the chunk's size) or compiled by torch.compile into a few fused kernels that read the logits once
# per pass and keep nothing of the chunk's size in float32 (`model.logprob_fusion`).


def _chunk_max(logits_c, pad_v):
    """Each row's max in the logits' own dtype (max commutes with the exact cast and with division by T > 0)."""
    chunk = logits_c if pad_v is None else logits_c.masked_fill(pad_v, float("-inf"))
    return chunk.amax(dim=-1).float()


def _chunk_stats(logits_c, max_c, idx_c, owned_c, temperature: float, pad_v):
    """[3, rows]: sum exp(z - max), sum exp(z - max) * (z - max), and the target's z - max where this rank owns it."""
    shifted = _scaled_chunk(logits_c, temperature, pad_v) - max_c.unsqueeze(-1)
    exp = shifted.exp()
    # H = log Z - sum p * shifted; padding (-inf, weight 0) contributes 0, not nan
    sum_exp_shifted = (exp * torch.where(torch.isinf(shifted), 0.0, shifted)).sum(-1)
    # where, not multiply: a slice that is all padding holds -inf, and -inf * 0 is nan
    target = torch.where(owned_c, shifted.gather(-1, idx_c.unsqueeze(-1)).squeeze(-1), 0.0)
    return torch.stack((exp.sum(-1), sum_exp_shifted, target))


def _chunk_grad(logits_c, max_c, log_z_c, mean_c, idx_c, owned_c, g_logp_c, g_ent_c, temperature: float, pad_v):
    """d loss / d logits of the chunk, in the logits' dtype: p * (-g_logp - g_ent * (z - mean)) + onehot * g_logp,
    over the temperature (the shift by the max cancels). g_logp_c or g_ent_c may be None (that output unused)."""
    shifted = _scaled_chunk(logits_c, temperature, pad_v) - max_c.unsqueeze(-1)
    probs = (shifted - log_z_c.unsqueeze(-1)).exp()
    coeff = 0.0  # per element, broadcast from [rows, 1] where it can be
    if g_logp_c is not None:
        coeff = -g_logp_c.unsqueeze(-1)
    if g_ent_c is not None:
        # dH/dz_i = -p_i (z_i - sum_j p_j z_j), z the shifted logits
        finite = torch.where(torch.isinf(shifted), 0.0, shifted)
        coeff = coeff - g_ent_c.unsqueeze(-1) * (finite - mean_c.unsqueeze(-1))
    grad = probs * coeff
    if g_logp_c is not None:
        # the one-hot as a comparison with the column index (fuses with the rest; no scatter pass)
        cols = torch.arange(logits_c.shape[-1], device=logits_c.device)
        hit = torch.where(owned_c, g_logp_c, 0.0).unsqueeze(-1)
        grad = grad + torch.where(cols == idx_c.unsqueeze(-1), hit, 0.0)
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits_c.dtype)


_EAGER = (_chunk_max, _chunk_stats, _chunk_grad)
_compiled: tuple | None = None
_fusion = "auto"


def set_fusion(setting: str) -> None:
    """`model.logprob_fusion`: auto (compiled on a GPU with Triton), on (always compiled, also on the CPU), off."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"model.logprob_fusion must be auto, on or off, not {setting!r}")
    global _fusion
    _fusion = setting


def _kernels(device: torch.device) -> tuple:
    """The chunk functions to run for logits on `device`: compiled where `set_fusion`'s setting applies."""
    if _fusion == "off" or (_fusion == "auto" and not (device.type == "cuda" and triton_available())):
        return _EAGER
    global _compiled
    if _compiled is None:
        # dynamic=None: a chunk of a new shape (the last, shorter one; another micro-batch length) recompiles once
        # with symbolic shapes, later ones reuse it
        _compiled = tuple(CompiledOrEager(f, "model.logprob_fusion", dynamic=None, fullgraph=True) for f in _EAGER)
    return _compiled


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
        chunk_max, chunk_stats, chunk_grad = _kernels(dev)
        # The kernels always see logits that do not require grad: a scoring pass (no grad) and the update's forward
        # then run the same compiled kernels, so equal logits give equal log-probs bit for bit (KL 0 at step 0);
        # torch.compile would otherwise compile another variant for the update, with other reduction splits.
        data = logits.detach()
        max_BT = torch.empty(B, T, dtype=torch.float32, device=dev)
        for c in chunks:
            max_BT[c] = chunk_max(data[c], pad_v)
        if temperature != 1.0:
            max_BT /= temperature
        if world > 1:
            dist.all_reduce(max_BT, op=dist.ReduceOp.MAX, group=group)
        owned = (targets >= start) & (targets < start + local_v)
        idx = (targets - start).clamp(0, local_v - 1)
        stats = torch.empty(3, B, T, dtype=torch.float32, device=dev)  # sum_exp, sum_exp_shifted, target
        for c in chunks:
            stats[(slice(None), *c)] = chunk_stats(data[c], max_BT[c], idx[c], owned[c], temperature, pad_v)
        if world > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, sum_exp_shifted, target_shifted = stats
        log_z = sum_exp.log()
        logp = target_shifted - log_z
        mean_shifted = sum_exp_shifted / sum_exp
        entropy = log_z - mean_shifted
        ctx.save_for_backward(logits, owned, idx, max_BT, log_z, mean_shifted)
        ctx.pad_v, ctx.temperature, ctx.chunks, ctx.chunk_grad = pad_v, temperature, chunks, chunk_grad
        ctx.set_materialize_grads(False)  # an output the loss does not use (often the entropy) costs no backward work
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, owned, idx, max_BT, log_z, mean_shifted = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return (None,) * 8
        data = logits.detach()
        grad_logits = torch.empty_like(data)
        for c in ctx.chunks:
            grad_logits[c] = ctx.chunk_grad(
                data[c],
                max_BT[c],
                log_z[c],
                mean_shifted[c],
                idx[c],
                owned[c],
                None if grad_logp is None else grad_logp[c],
                None if grad_entropy is None else grad_entropy[c],
                ctx.temperature,
                ctx.pad_v,
            )
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
