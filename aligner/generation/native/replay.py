"""Megatron's forward with the generation engine's roundings put in by hooks: the references its FP8 paths are
checked against (tests/unit/test_generation_fp8.py, test_generation_engine.py, benchmarks/probes/fp8_reference.py).

Contract: each is a context manager around megatron's forward of a GPTModel (any TP); inside it the forward rounds
as the engine does, outside it nothing of the model is changed.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


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
        out = fake if everywhere else torch.where(decoded_SB1.to(out.device), fake, out)
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
    engine's prefill attends to them so too). Where the attention scales the channels RoPE passes
    (SDPAttention.passed_channels), the engine's cache holds the key so scaled: it is quantized so here too."""
    from aligner.generation.native.triton_decode import quantize_fp8
    from aligner.models.attention import scale_channels_from

    def dequantized(t):
        t8, s = quantize_fp8(t)
        return (t8.float() * s[..., None]).to(t.dtype)

    def hook(module, args):
        query, key, value, *rest = args
        passed = getattr(module, "passed_channels", None)
        if passed is None:
            return (query, dequantized(key), dequantized(value), *rest)
        first, scale = passed
        key = dequantized(scale_channels_from(key, first, scale))
        key = scale_channels_from(key, first, 1 / scale)  # (the attention scales them again)
        return (query, key, dequantized(value), *rest)

    handles = [layer.self_attention.core_attention.register_forward_pre_hook(hook) for layer in model.decoder.layers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
