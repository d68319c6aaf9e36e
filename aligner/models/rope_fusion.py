"""Rotary embeddings in one fused kernel where Transformer Engine's fused RoPE is absent (`model.rope_fusion`).

megatron-core applies RoPE to queries and keys through `rope_utils.apply_rotary_pos_emb`. Without TE it runs the
unfused form: a multiply, a negation, a concatenation (rotate_half), another multiply, an add and a final
concatenation, each a pass over the [sequence, batch, heads, head_dim] tensor, forward and backward; on an H200
that was about 6 % of a 1B model's training step (docs/PERF.md). With `config.apply_rope_fusion` megatron calls
`rope_utils.fused_apply_rotary_pos_emb` instead, which it imports from TE (None without it). `install()` fills that
seam with `fused_rope`, the same maths as megatron's unfused non-interleaved form (`rope_bshd`) in one pass:

- on a GPU (and on the CPU under Triton's interpreter, as the tests run it), our Triton kernel `rope_rows` behind
  one autograd function (`rope_kernel`): one launch forward, one backward (the rotation transposed). It
  replaced torch.compile's kernel for its call path: dynamo's guards and AOT autograd's wrappers around each of the
  two calls a layer took ~16 % of the host's time in a host-bound SFT step (docs/PERF.md, thirty-ninth session);
- elsewhere (`rope_fusion: on` on the CPU) `rope_bshd` compiled by torch.compile (inductor's C++ kernels).

The kernel rounds cos and sin to the tensor's dtype, as megatron's unfused form, HF's Llama and the generation
engine do, then computes in float32 and rounds once: bf16 results may differ from megatron's unfused form (which
rounds after each operation) in the last bit. The compiled form keeps cos and sin in float32 (inductor drops the
intermediate rounding): about a quarter of its bf16 results differ from the kernel's in the last bit (docs/PERF.md,
forty-first session). Where TE is installed, its kernel stays.
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from aligner.models.compiled import CompiledOrEager
from aligner.parallel.device import triton_available, triton_kernels_unavailable

log = logging.getLogger(__name__)

_compiled = None
_kernel_refusals: dict[torch.device, str | None] = {}  # why the Triton kernel cannot run on a device (None: it can)
_kernel_failure: str | None = None  # the kernel's launch error, once it happened: the compiled form from then on


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved, mscale 1): t [s, b, h, d], freqs [s, 1, 1, r<=d]
    in float32; the first r channels rotated, the rest passed through."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_rows(
        t_ptr, f_ptr, o_ptr, B, H, st_s, st_b, st_h, sf_s, sf_b,
        HALF: tl.constexpr, REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_REST: tl.constexpr, BACKWARD: tl.constexpr,
    ):  # fmt: skip
        """One program: BLOCK_H heads of one (position, sample) row. Forward o1 = x1 c1 - x2 s1, o2 = x2 c2 + x1 s2
        (x1, x2 the rotated channels' halves); backward, the transpose: the same with s1, s2 -> -s2, -s1."""
        row = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements: micro-batches of 256k tokens at 64 heads
        s, b = row // B, row % B
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        j = tl.arange(0, BLOCK_R)
        h_ok, j_ok = heads < H, j < HALF
        ok = h_ok[:, None] & j_ok[None, :]
        dtype = o_ptr.dtype.element_ty
        f = f_ptr + s * sf_s + b * sf_b + j
        f1 = tl.load(f, mask=j_ok, other=0.0).to(tl.float32)
        f2 = tl.load(f + HALF, mask=j_ok, other=0.0).to(tl.float32)
        c1, c2 = tl.cos(f1).to(dtype).to(tl.float32), tl.cos(f2).to(dtype).to(tl.float32)
        s1, s2 = tl.sin(f1).to(dtype).to(tl.float32), tl.sin(f2).to(dtype).to(tl.float32)
        if BACKWARD:
            s1, s2 = -s2, -s1
        src = t_ptr + s * st_s + b * st_b + heads[:, None] * st_h
        x1 = tl.load(src + j[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + j[None, :], mask=ok, other=0.0).to(tl.float32)
        dst = o_ptr + row * H * (2 * HALF + REST) + heads[:, None] * (2 * HALF + REST)
        tl.store(dst + j[None, :], (x1 * c1[None, :] - x2 * s1[None, :]).to(dtype), mask=ok)
        tl.store(dst + HALF + j[None, :], (x2 * c2[None, :] + x1 * s2[None, :]).to(dtype), mask=ok)
        if REST > 0:  # channels past the rotary part (rotary_percent < 1) pass through
            p = tl.arange(0, BLOCK_REST)
            p_ok = h_ok[:, None] & (p < REST)[None, :]
            rest = tl.load(src + 2 * HALF + p[None, :], mask=p_ok, other=0.0)
            tl.store(dst + 2 * HALF + p[None, :], rest, mask=p_ok)

    return rope_rows


def _launch(t: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    """`rope_rows` over t [s, b, h, d] (any strides) with freqs [s, 1 or b, 1, r]: a new contiguous tensor."""
    import triton

    t = t if t.stride(-1) == 1 else t.contiguous()
    freqs = freqs if freqs.stride(-1) == 1 else freqs.contiguous()
    S, B, H, D = t.shape
    out = torch.empty((S, B, H, D), dtype=t.dtype, device=t.device)
    half, rest = freqs.shape[-1] // 2, D - freqs.shape[-1]
    block_r = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(H), max(1, 2048 // block_r))
    grid = (S * B, triton.cdiv(H, block_h))
    _kernel()[grid](
        t, freqs, out, B, H, t.stride(0), t.stride(1), t.stride(2), freqs.stride(0),
        freqs.stride(1) if freqs.shape[1] > 1 else 0,
        HALF=half, REST=rest, BLOCK_H=block_h, BLOCK_R=block_r,
        BLOCK_REST=triton.next_power_of_2(max(rest, 1)), BACKWARD=backward, num_warps=4,
    )  # fmt: skip
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        return _launch(t, freqs, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (freqs,) = ctx.saved_tensors
        return _launch(grad, freqs, backward=True), None  # megatron's frequencies take no gradient


def rope_kernel(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`rope_bshd` by the Triton kernel, forward and backward."""
    return _Rope.apply(t, freqs)


def _kernel_takes(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the Triton kernel runs this call: on a device it runs on (asked once a device), t [s, b, h, d] and
    freqs [s, 1 or b, 1, r] with an even r <= d (the shapes megatron passes; others take the compiled form)."""
    if t.device not in _kernel_refusals:
        _kernel_refusals[t.device] = triton_kernels_unavailable(t.device)
    if _kernel_failure is not None or _kernel_refusals[t.device] is not None:
        return False
    shaped = t.dim() == 4 and freqs.dim() == 4 and freqs.shape[0] == t.shape[0] and freqs.shape[1] in (1, t.shape[1])
    return shaped and freqs.shape[-1] % 2 == 0 and freqs.shape[-1] <= t.shape[-1]


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The signature megatron calls (TE's `fused_apply_rotary_pos_emb`): the Triton kernel where it runs, else
    `rope_bshd` compiled on first use."""
    global _compiled, _kernel_failure
    if interleaved:
        raise NotImplementedError("aligner's fused RoPE implements the non-interleaved form only")
    if _kernel_takes(t, freqs):
        try:
            return rope_kernel(t, freqs)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - an accelerator: the compiled form computes the same
            _kernel_failure = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            log.warning(
                "model.rope_fusion: the Triton RoPE kernel failed (%s); the compiled form runs from now on",
                _kernel_failure,
            )
    if _compiled is None:
        # dynamic=None: the first new sequence length recompiles once with symbolic shapes, later ones reuse it
        _compiled = CompiledOrEager(rope_bshd, "model.rope_fusion", dynamic=None, fullgraph=True)
    return _compiled(t, freqs)


def install() -> str:
    """Make megatron's fused-RoPE path available; returns whose kernel it runs ("transformer_engine" or "aligner")."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return "aligner" if rope_utils.fused_apply_rotary_pos_emb is fused_rope else "transformer_engine"


def wanted(setting: str, rope: bool, interleaved: bool, gpu: bool) -> bool:
    """Whether `model.rope_fusion` (auto | on | off) applies: a RoPE family in megatron's default form; auto only on
    a GPU where Triton is importable."""
    if setting == "off" or not rope or interleaved:
        return False
    if setting == "on":
        return True
    return gpu and triton_available()
