"""No-cache references for the generation engine tests: megatron's own forward, recomputed for every new token.

Works at any TP: the vocab-parallel logits are all-gathered over megatron's TP group before the argmax, and the
training-side log-probs go through `aligner.models.logprobs.vocab_parallel_logprobs` exactly as the PPO loss does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.models.gpt import forward
from aligner.models.logprobs import shift_for_next_token, vocab_parallel_logprobs


def full_logits(model, tokens_BT: torch.Tensor, vocab_size: int) -> torch.Tensor:
    local = forward(model, tokens_BT)
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :vocab_size].float()


@torch.no_grad()
def reference_greedy(model, prompts_BT, lengths_B, max_new: int, vocab_size: int, end_ids=(), min_new: int = 0):
    """Greedy responses (lists of ids, ending token included) by a full forward pass per new token."""
    out = []
    for b in range(prompts_BT.shape[0]):
        seq = prompts_BT[b, : int(lengths_B[b])].tolist()
        response = []
        for step in range(max_new):
            logits = full_logits(model, torch.tensor([seq]), vocab_size)[0, -1]
            if step < min_new and end_ids:
                logits[list(end_ids)] = float("-inf")
            token = int(logits.argmax())
            seq.append(token)
            response.append(token)
            if token in end_ids:
                break
        out.append(response)
    return out


@torch.no_grad()
def training_logprobs(
    model, prompts_BT, lengths_B, responses_BR, response_lengths_B, temperature: float, vocab_size: int
) -> torch.Tensor:
    """Log-probs of the response tokens as training computes them (right-padded batch, one forward), [B, R]."""
    B, R = responses_BR.shape
    seqs = []
    for b in range(B):
        p, n = int(lengths_B[b]), int(response_lengths_B[b])
        seqs.append(prompts_BT[b, :p].tolist() + responses_BR[b, :n].tolist())
    width = max(len(s) for s in seqs)
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    tp_group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    logits, targets = shift_for_next_token(forward(model, tokens), tokens)
    logp_BT = vocab_parallel_logprobs(logits, targets, tp_group, temperature=temperature, vocab_size=vocab_size)
    out = torch.zeros(B, R)
    for b in range(B):
        p, n = int(lengths_B[b]), int(response_lengths_B[b])
        out[b, :n] = logp_BT[b, p - 1 : p - 1 + n]
    return out


def candidate_mask(logits_BV: torch.Tensor, temperature, top_k: int, top_p: float | None) -> torch.Tensor:
    """Bool [B, V]: the tokens top-k / top-p allow (the reference for the engine's sorted-candidate sampling)."""
    scaled = logits_BV.float() / temperature
    order = scaled.argsort(dim=-1, descending=True, stable=True)
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    ranks = torch.empty_like(order).scatter_(-1, order, positions)
    allowed = torch.ones_like(scaled, dtype=torch.bool)
    if top_k:
        allowed &= ranks < top_k
        scaled = scaled.masked_fill(~allowed, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs_sorted = torch.softmax(scaled.gather(-1, order), -1)
        keep_sorted = (probs_sorted.cumsum(-1) - probs_sorted) < top_p
        allowed &= keep_sorted.gather(-1, ranks)
    return allowed
