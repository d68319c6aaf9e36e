"""RoPE's inverse frequencies from a ModelConfig: plain, or with Llama 3.1's "llama3" scaling.

`rope_inv_freq(cfg)` is the one place they are computed: `build_gpt` installs them in megatron's RotaryEmbedding
(whose own llama3 scaling fixes low_freq_factor=1, high_freq_factor=4 and original_max_position_embeddings=8192,
and whose base is cast to int), and the native engine reads them off the model it generates for.
The maths is Hugging Face's (`transformers.modeling_rope_utils`, default and llama3), op for op in float32, so
the frequencies are bit-identical to those of the HF model a checkpoint was converted from:
  inv_freq_i = 1 / base^(2i / d), i < d/2;
  llama3: wavelen = 2*pi / inv_freq; wavelen above original/low_freq_factor: inv_freq / factor; below
  original/high_freq_factor: unchanged; between: (1 - s) * inv_freq / factor + s * inv_freq with
  s = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor).
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(cfg) -> torch.Tensor:
    """float32 [head_dim / 2] on the CPU."""
    dim = cfg.kv_channels
    inv_freq = 1.0 / (float(cfg.rotary_base) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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
