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
