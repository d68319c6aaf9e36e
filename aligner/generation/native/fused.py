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


@dataclass
class Kernels:
    norm: Callable  # norm(x, w, b) -> normed x
    add_norm: Callable  # add_norm(x, a, bias, w, b) -> (x + (a + bias), norm of it): residual add fused with next norm
    act: Callable  # act(h) -> act(gate) * up over [gate; up] halves (a gated MLP: SwiGLU) or act(h)
    # rope_split(qkv [..., G, r+2, D], cos, sin_signed, q_norm_w, q_norm_b, k_norm_w, k_norm_b)
    #   -> (q [..., G, r, D], kv [2, ..., G, D]): q/k normed per head (with qk_norm), then rotated
    rope_split: Callable


def make_kernels(
    family: FamilySpec, eps: float, compile_: bool, qk_norm: bool = False, prefill: bool = False
) -> Kernels:
    """The kernels of one family; `compile_` wraps each in torch.compile, for the decode step's fixed shapes, or with
    `prefill` for any batch and prompt width (symbolic shapes) and with q returned contiguous: prefill's attention
    reads it as [B, H, T, D] without a copy, where a decode step's attention reads the strided view (a separate
    contiguous q costs the step a second RoPE kernel: measured slower on the H200)."""
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
            qk = qk * cos + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * sin_signed
        q = qk[..., :r, :]
        return q.contiguous() if prefill else q, torch.stack((qk[..., r, :], qkv[..., r + 1, :]))

    if not compile_:
        return Kernels(norm=norm, add_norm=add_norm, act=act, rope_split=rope_split)
    if prefill:
        wrap = _batch_and_length_dynamic
    else:
        wrap = lambda fn: torch.compile(fn, dynamic=False, fullgraph=True)  # noqa: E731
    return Kernels(norm=wrap(norm), add_norm=wrap(add_norm), act=wrap(act), rope_split=wrap(rope_split))


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
