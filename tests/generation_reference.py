"""No-cache references for the generation engine tests: megatron's own forward, recomputed for every new token.

Works at any TP: the vocab-parallel logits are all-gathered over megatron's TP group before the argmax, and the
training-side log-probs go through `aligner.models.logprobs.vocab_parallel_logprobs` exactly as the PPO loss does.
"""

from __future__ import annotations

import contextlib
import functools

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


@contextlib.contextmanager
def fake_fp8(model, lengths_B, width: int, qkv: bool = False):
    """Megatron's forward with the rounding of FP8 decode weights (aligner.generation.native.fp8): fc1 and fc2 (with
    `qkv`, linear_qkv too: the engine's split-K path) compute quantize(input) @ quantize(W)^T (per row, dequantized)
    at every position (decode steps and prefill), the output layer at every position past each prompt (decode steps;
    prefill's stays in the engine's dtype), sequences of `width` tokens. Row-parallel layers sum the ranks' partial
    products, each in its own scales, as the engine does."""
    from aligner.generation.native.fp8 import quantize_rows

    decoded_SB1 = (torch.arange(width)[:, None] >= lengths_B[None, :])[..., None]  # megatron's [sequence, batch]

    def q(t):
        t8, s = quantize_rows(t)
        return t8.float() * s

    def hook(module, args, kwargs, output, everywhere: bool = False):
        out, bias = output if isinstance(output, tuple) else (output, None)
        weight = kwargs.get("weight") if kwargs.get("weight") is not None else module.weight  # tied: the embedding
        fake = (q(args[0]) @ q(weight).t()).to(out.dtype)
        if bias is None and getattr(module, "bias", None) is not None and not module.skip_bias_add:
            fake = fake + module.bias  # a bias the layer added to its own output (linear_qkv)
        if getattr(module, "input_is_parallel", False) and ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(fake, group=ps.get_tensor_model_parallel_group())
        out = fake if everywhere else torch.where(decoded_SB1, fake, out)
        return (out, bias) if isinstance(output, tuple) else out

    everywhere = [m for layer in model.decoder.layers for m in (layer.mlp.linear_fc1, layer.mlp.linear_fc2)]
    if qkv:
        everywhere += [layer.self_attention.linear_qkv for layer in model.decoder.layers]
    handles = [m.register_forward_hook(functools.partial(hook, everywhere=True), with_kwargs=True) for m in everywhere]
    handles.append(model.output_layer.register_forward_hook(hook, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def fp8_kv_cache(model):
    """Megatron's forward attending to keys and values as an FP8 KV cache holds them (generation.kv_dtype=fp8): each
    (token, group)'s key and value quantized by triton_decode.quantize_fp8 and dequantized, at every position (the
    engine's prefill attends to them so too)."""
    from aligner.generation.native.triton_decode import quantize_fp8

    def dequantized(t):
        t8, s = quantize_fp8(t)
        return (t8.float() * s[..., None]).to(t.dtype)

    def hook(module, args):
        query, key, value, *rest = args
        return (query, dequantized(key), dequantized(value), *rest)

    handles = [layer.self_attention.core_attention.register_forward_pre_hook(hook) for layer in model.decoder.layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
