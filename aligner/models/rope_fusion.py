"""Rotary embeddings in one fused kernel where Transformer Engine's fused RoPE is absent (`model.rope_fusion`).

megatron-core applies RoPE to queries and keys through `rope_utils.apply_rotary_pos_emb`. Without TE it runs the
unfused form: a multiply, a negation, a concatenation (rotate_half), another multiply, an add and a final
concatenation, each a pass over the [sequence, batch, heads, head_dim] tensor, forward and backward; on an H200
that was about 6 % of a 1B model's training step (docs/PERF.md). With `config.apply_rope_fusion` megatron calls
`rope_utils.fused_apply_rotary_pos_emb` instead, which it imports from TE (None without it). `install()` fills that
seam with `fused_rope`: the same maths as megatron's unfused non-interleaved form, compiled by torch.compile into
one kernel forward and a few backward (intermediates in float32, one rounding: bf16 results may differ in the last
bit). Where TE is installed, its kernel stays.
"""

from __future__ import annotations

import torch

from aligner.models.compiled import CompiledOrEager
from aligner.parallel.device import triton_available

_compiled = None


def rope_bshd(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved, mscale 1): t [s, b, h, d], freqs [s, 1, 1, r<=d]
    in float32; the first r channels rotated, the rest passed through."""
    rot = freqs.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)


def fused_rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The signature megatron calls (TE's `fused_apply_rotary_pos_emb`); compiled on first use."""
    if interleaved:
        raise NotImplementedError("aligner's fused RoPE implements the non-interleaved form only")
    global _compiled
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
    a GPU where Triton (torch.compile's GPU backend) is importable."""
    if setting == "off" or not rope or interleaved:
        return False
    if setting == "on":
        return True
    return gpu and triton_available()
