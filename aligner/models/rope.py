"""RoPE's inverse frequencies from a ModelConfig: plain, with Llama 3.1's "llama3" scaling or LongRoPE's short factors.

`rope_inv_freq(cfg)` is the one place they are computed: `build_gpt` installs them in megatron's RotaryEmbedding
(whose own llama3 scaling fixes low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192,
and whose base is cast to int), and the native engine reads them off the model it generates for.
The maths is Hugging Face's (`transformers.modeling_rope_utils`, default, llama3, longrope), op for op in float32, so
the frequencies are bit-identical to those of the HF model a checkpoint was converted from:
  inv_freq_i = 1 / base^(2i / d), i < d/2;
  llama3: wavelen = 2*pi / inv_freq; wavelen above original/low_freq_factor: inv_freq / factor; below
  original/high_freq_factor: unchanged; between: (1 - s) * inv_freq / factor + s * inv_freq with
  s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
  longrope (within the pre-training context): inv_freq_i = 1 / (short_factor_i * base^(2i / d)). Its attention
  factor (on cos and sin, so on q and k alike) is the attention's: `softmax_scale(cfg)`;
with d the rotated width: the whole head, or its first rotary_percent (Phi-4-mini: 3/4), the rest passed through.
"""

from __future__ import annotations

import math

import torch

from aligner.config.schema import rotated_width


def rope_inv_freq(cfg) -> torch.Tensor:
    """float32 [rotated width / 2] on the CPU (rotated width = head width x rotary_percent, HF's and megatron's)."""
    dim = rotated_width(cfg)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if cfg.rope_scaling == "longrope":
        short = torch.tensor(cfg.rope_scaling_short_factor, dtype=torch.float32)
        return 1.0 / (short * float(cfg.rotary_base) ** exponents)
    inv_freq = 1.0 / (float(cfg.rotary_base) ** exponents)
    if cfg.rope_scaling is None:
        return inv_freq
    if cfg.rope_scaling != "llama3":
        raise ValueError(f"unknown rope_scaling {cfg.rope_scaling!r}")
    factor = cfg.rope_scaling_factor
    low, high = cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor
    original = cfg.rope_scaling_original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def softmax_scale(cfg) -> float | None:
    """The attention's logit scale where it is not 1 / sqrt(head width), else None (megatron's default).

    LongRoPE multiplies cos and sin by its attention factor a, so both rotated q and k by a: their product, by a^2.
    The scale carries it instead (a^2 / sqrt(d)), the same function in exact arithmetic, with nothing added to any
    RoPE kernel (megatron's, the fused ones, the generation engine's).
    """
    if cfg.rope_scaling != "longrope" or cfg.rope_scaling_attention_factor == 1.0:
        return None
    return cfg.rope_scaling_attention_factor**2 / math.sqrt(cfg.kv_channels)


def passed_channel_scale(cfg) -> float | None:
    """With part of each head rotated (rotary_percent < 1) the attention factor a scales only the rotated channels'
    product; the scale a^2 / sqrt(d) then also needs the passed channels of q and k each divided by a (so their
    product by a^2): this factor, 1 / a, applied by the attention (aligner.models.attention, the engine's RoPE tables).
    None where nothing is passed or a = 1."""
    if softmax_scale(cfg) is None or rotated_width(cfg) == cfg.kv_channels:
        return None
    return 1.0 / cfg.rope_scaling_attention_factor
