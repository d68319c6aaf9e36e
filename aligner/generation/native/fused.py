"""The elementwise pieces of a decoder layer, written so that one call is one fused kernel under torch.compile.

In a captured decode step the GEMMs read the weights and the KV cache at memory speed, but every small elementwise
kernel (residual add, norm, RoPE, activation) still costs a few microseconds of GPU time, hundreds per step. These
functions group each run of elementwise work between two GEMMs; `make_kernels(compile_=True)` wraps them in
`torch.compile(dynamic=False)` (Triton kernels, captured inside our own CUDA graph like any other kernel; prefill's
with batch and prompt width dynamic, one compilation for all of them, where the eager ops would be a dozen passes
over activations of hundreds of MB per layer), and with
`compile_=False` they run as plain PyTorch ops (CPU, tests, or where Triton is absent). Both compute the same maths;
compiled kernels keep intermediates in float32 and round once, so bf16 results may differ in the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from aligner.families import FamilySpec
from aligner.generation.native import pdl
from aligner.generation.native.fp8 import dequantize, quantize_rows


@dataclass
class Kernels:
    norm: Callable  # norm(x, w, b) -> normed x
    add_norm: Callable  # add_norm(x, a, bias, w, b) -> (x + (a + bias), norm of it): residual add fused with next norm
    act: Callable  # act(h) -> act(gate) * up over [gate; up] halves (a gated MLP: SwiGLU) or act(h)
    # rope_split(qkv [..., G, r+2, D], cos, sin_signed, q_norm_w, q_norm_b, k_norm_w, k_norm_b)
    #   -> (q [..., G, r, D], kv [2, ..., G, D]): q/k normed per head (with qk_norm), then rotated
    rope_split: Callable
    # FP8 decode weights (aligner.generation.native.fp8): the same pieces with the GEMM input quantized per row on
    # the way out (`_q`: (..., x8, row scales)) or an FP8 GEMM's float32 result dequantized on the way in (`dq_`).
    norm_q: Callable | None = None  # (x, w, b) -> (h8, h scales)
    add_norm_q: Callable | None = None  # (x, a, bias, w, b) -> (x, h8, h scales)
    act_q: Callable | None = None  # (y, y scales, w scales, fc1 bias, dtype) -> (m8, m scales)
    dq: Callable | None = None  # (y, y scales, w scales, dtype) -> y in dtype
    dq_add_norm: Callable | None = None  # (x, y, y scales, w scales, bias, w, b) -> (x, h)
    dq_add_norm_q: Callable | None = None  # (x, y, y scales, w scales, bias, w, b) -> (x, h8, h scales)
    q: Callable | None = None  # (m) -> (m8, m scales): the activation of splitk.gated_matmul_fp8, quantized per row
    # A row-parallel projection's float32 partial sums [S, ..., H] from the split-K GEMM (splitk.py), summed and
    # rounded to x's dtype on the way in (where cuBLAS rounds its product): add_norm's and add_norm_q's results
    add_parts_norm: Callable | None = None  # (x, parts, bias, w, b) -> (x, h)
    add_parts_norm_q: Callable | None = None  # (x, parts, bias, w, b) -> (x, h8, h scales)


def make_kernels(
    family: FamilySpec,
    eps: float,
    compile_: bool,
    qk_norm: bool = False,
    prefill: bool = False,
    max_batch: int = 64,
    pdl_device: torch.device | None = None,
    rotated: int | None = None,
) -> Kernels:
    """The kernels of one family; `compile_` wraps each in torch.compile, for the decode step's fixed shapes (each
    batch size up to `max_batch` its own compilation: allow_recompiles), or with
    `prefill` for any batch and prompt width (symbolic shapes) and with q returned contiguous: prefill's attention
    reads it as [B, H, T, D] without a copy, where a decode step's attention reads the strided view (a separate
    contiguous q costs the step a second RoPE kernel: measured slower on the H200). With `pdl_device` the decode
    kernels are compiled for programmatic dependent launch there (aligner.generation.native.pdl), where it can.
    `rotated`: the channels of a head RoPE rotates, where fewer than all (rotary_percent < 1; the RoPE tables pass the
    rest with sin 0)."""
    # The family's traits as plain Python values, read here once: the kernels branch on constants only.
    rms, gated, rope = family.normalization == "RMSNorm", family.gated_mlp, family.rope
    act_fn = family.activation_func()

    def norm(x, w, b):
        if rms:
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    def add_norm(x, a, bias, w, b):
        # megatron's order: residual + (output + bias)
        x = x + (a if bias is None else a + bias)
        return x, norm(x, w, b)

    def act(h):
        if gated:
            gate, up = h.chunk(2, dim=-1)
            return act_fn(gate) * up
        return act_fn(h)

    def rope_split(qkv, cos, sin_signed, qn_w=None, qn_b=None, kn_w=None, kn_b=None):
        r = qkv.shape[-2] - 2
        qk = qkv[..., : r + 1, :]
        if qk_norm:
            # megatron's q_layernorm / k_layernorm: the family's norm over each head's width, before RoPE
            qk = torch.cat((norm(qk[..., :r, :], qn_w, qn_b), norm(qk[..., r:, :], kn_w, kn_b)), dim=-2)
        if rope:
            # megatron: t*cos + rotate_half(t)*sin, rotate_half(t) = [-t2, t1]; with sin_signed = [-sin, sin]
            # that is t*cos + [t2, t1]*sin_signed, and [t2, t1] is a roll by half the head dimension.
            # With part of the head rotated: the roll over that part, the rest in place (its sin_signed is 0).
            if rotated is None or rotated == qk.shape[-1]:
                swapped = torch.roll(qk, qk.shape[-1] // 2, dims=-1)
            else:
                swapped = torch.cat((torch.roll(qk[..., :rotated], rotated // 2, dims=-1), qk[..., rotated:]), dim=-1)
            qk = qk * cos + swapped * sin_signed
        q = qk[..., :r, :]
        return q.contiguous() if prefill else q, torch.stack((qk[..., r, :], qkv[..., r + 1, :]))

    def norm_q(x, w, b):
        return quantize_rows(norm(x, w, b))

    def add_norm_q(x, a, bias, w, b):
        x, h = add_norm(x, a, bias, w, b)
        return (x, *quantize_rows(h))

    def act_q(y, y_scale, w_scale, bias, dtype):
        a = dequantize(y, y_scale, w_scale, dtype)
        return quantize_rows(act(a if bias is None else a + bias))

    def dq_add_norm(x, y, y_scale, w_scale, bias, w, b):
        return add_norm(x, dequantize(y, y_scale, w_scale, x.dtype), bias, w, b)

    def dq_add_norm_q(x, y, y_scale, w_scale, bias, w, b):
        x, h = dq_add_norm(x, y, y_scale, w_scale, bias, w, b)
        return (x, *quantize_rows(h))

    def add_parts_norm(x, parts, bias, w, b):
        return add_norm(x, parts.sum(0).to(x.dtype), bias, w, b)

    def add_parts_norm_q(x, parts, bias, w, b):
        return add_norm_q(x, parts.sum(0).to(x.dtype), bias, w, b)

    plain = dict(
        norm=norm, add_norm=add_norm, act=act, rope_split=rope_split,
        add_norm_q=add_norm_q, act_q=act_q, dq=dequantize, dq_add_norm=dq_add_norm,  # FP8 MLP (prefill too)
        norm_q=norm_q, dq_add_norm_q=dq_add_norm_q,  # FP8 qkv (prefill too)
    )  # fmt: skip
    if not prefill:
        plain.update(add_parts_norm=add_parts_norm, add_parts_norm_q=add_parts_norm_q, q=quantize_rows)
    if not compile_:
        return Kernels(**plain)
    if prefill:
        wrap = _batch_and_length_dynamic
    else:
        allow_recompiles(max_batch)
        options = pdl.inductor_options(pdl_device) if pdl_device is not None else {}
        wrap = lambda fn: torch.compile(fn, dynamic=False, fullgraph=True, options=options or None)  # noqa: E731
    return Kernels(**{name: wrap(fn) for name, fn in plain.items()})


def allow_recompiles(max_batch: int) -> None:
    """Let every decode batch size compile its own kernels. torch.compile(dynamic=False) specializes a function to
    its input shapes and compiles again for new ones, but only up to dynamo's recompile limit per function (8 by
    default); past it a fullgraph function fails outright ("Hard failure due to fullgraph=True"): an engine that met
    a ninth batch size (the last, smaller chunk of rollouts, dynamic sampling's draws) stopped. The limit is
    process-wide: raised, never lowered, to cover each batch size with and without the split-K partial sums."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 2 * max_batch + 8)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * max_batch + 256)


def _batch_and_length_dynamic(fn: Callable) -> Callable:
    """`fn` compiled once for every batch size and prompt width, with the model's own sizes (hidden, heads, head
    dimension) fixed. Prefill's activations are [B, T, ...] and its RoPE tables [T, 1, 1, D]: the first two
    dimensions of a tensor of three or more are marked dynamic before each call. (`dynamic=True` made every size
    symbolic: the RoPE kernel's roll by D/2 then computed its indices from a symbolic D, 1.8 ms a call on the H200
    for 32k tokens, several times its memory time.)"""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 3:
                torch._dynamo.maybe_mark_dynamic(a, 0)
                torch._dynamo.maybe_mark_dynamic(a, 1)
        return compiled(*args)

    return call
