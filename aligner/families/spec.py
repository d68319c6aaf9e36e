"""The shape of a family spec: `FamilySpec` (the model's traits) and `HFFormat` (how Hugging Face stores it).

Pure data and small helpers, no torch at import time (see the package docstring for who reads what).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

NORMALIZATIONS = ("RMSNorm", "LayerNorm")  # megatron's names
ACTIVATIONS = ("silu", "gelu_tanh")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")  # megatron's position_embedding_type
# config.json 'rope_parameters' keys of a "llama3" RoPE (all four required, as in HF) -> ModelConfig fields
LLAMA3_ROPE_KEYS = (
    ("factor", "rope_scaling_factor"),
    ("low_freq_factor", "rope_scaling_low_freq_factor"),
    ("high_freq_factor", "rope_scaling_high_freq_factor"),
    ("original_max_position_embeddings", "rope_scaling_original_max_position_embeddings"),
)
# the ModelConfig fields of a "longrope" RoPE (aligner.checkpoint.hf reads them off config.json)
LONGROPE_FIELDS = (
    "rope_scaling_original_max_position_embeddings",
    "rope_scaling_attention_factor",
    "rope_scaling_short_factor",
    "rope_scaling_long_factor",
)


class UnsupportedModelError(ValueError):
    """The HF checkpoint uses an architecture or a feature the megatron model cannot express."""


def hf_get(cfg, name, default=None):
    """A field of an HF config, given as the config.json dict or as a transformers config object."""
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


def hf_rope(hf_cfg) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, all rope parameters) from `rope_parameters` (transformers 5) or rope_theta and
    rope_scaling (transformers 4)."""
    params = dict(hf_get(hf_cfg, "rope_parameters") or hf_get(hf_cfg, "rope_scaling") or {})
    theta = params.get("rope_theta", hf_get(hf_cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return float(theta), rope_type, params


def partial_rotary_factor(hf_cfg, params: dict) -> float:
    """The share of each head RoPE rotates: the rope parameters' or the config's top level (Phi-4-mini: 0.75)."""
    partial = params.get("partial_rotary_factor", hf_get(hf_cfg, "partial_rotary_factor", 1.0))
    return 1.0 if partial is None else float(partial)


def longrope_numbers(hf_cfg, params: dict) -> tuple[int | None, float]:
    """(original_max_position_embeddings, attention_factor) of a "longrope" RoPE (Phi-3 128k, Phi-3.5), as
    transformers reads them: the pre-training context from the rope parameters or the config's top level; the factor
    on cos and sin given, or sqrt(1 + ln(s) / ln(original)) for s = the given 'factor' or max_position_embeddings /
    original (1 where s <= 1). The full max_position_embeddings counts here even where positions are capped."""
    original = params.get("original_max_position_embeddings") or hf_get(hf_cfg, "original_max_position_embeddings")
    if original is None:
        return None, 1.0
    attention = params.get("attention_factor")
    if attention is None:
        scale = params.get("factor") or hf_get(hf_cfg, "max_position_embeddings") / original
        attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
    return int(original), float(attention)


def nope_layers(hf_cfg) -> list[int]:
    """The layers (0-based) that attend without RoPE, as transformers' SmolLM3 reads config.json: 'no_rope_layers'
    (one entry per layer, 0 = no RoPE), or every 'no_rope_layer_interval'-th layer (default 4) where it is absent."""
    flags = hf_get(hf_cfg, "no_rope_layers")
    layers = hf_get(hf_cfg, "num_hidden_layers")
    if flags is None:
        interval = hf_get(hf_cfg, "no_rope_layer_interval", 4) or 4
        return [i for i in range(layers) if (i + 1) % interval == 0]
    return [i for i, uses_rope in enumerate(flags[:layers]) if not uses_rope]


@dataclass(frozen=True)
class HFVariant:
    """One HF model type of a family (Mistral and Qwen2 are variants of the Llama family)."""

    model_type: str  # config.json 'model_type'
    causal_lm: str  # the policy's architecture (config.json 'architectures')
    classifier: str  # the reward model's: *ForSequenceClassification with one label
    config_class: str  # the transformers config class that writes config.json when no source config is kept
    qkv_bias: bool = False  # q/k/v projections carry biases (ModelConfig.add_qkv_bias)
    qk_layernorm: bool = False  # per-head q/k norms (ModelConfig.qk_layernorm; HFFormat.qk_norm_modules)
    # a config.json 'sliding_window' windows every layer (Mistral, Phi-3), unless 'layer_types' / 'use_sliding_window'
    # say which layers (Qwen2, Qwen3)
    window_every_layer: bool = False
    partial_rotary: bool = False  # HF's model rotates the first partial_rotary_factor of each head (Phi-3: Phi-4-mini)
    # some layers attend without RoPE, as config.json 'no_rope_layers' marks them (SmolLM3: every fourth; nope_layers)
    nope: bool = False


@dataclass(frozen=True)
class HFFormat:
    """The family's Hugging Face checkpoints: config.json keys and tensor names.

    Weight names: an HF tensor is `<prefix><layer.format(i=i)><module>.weight|.bias` inside a layer, or
    `<prefix><module>.weight|.bias` outside. `layer_modules` pairs each megatron module of a layer with its HF
    module(s); more than one HF module means megatron fuses them: three for linear_qkv (q, k, v, fused per KV
    group) and two for a gated linear_fc1 ([gate; up]). A single HF module for linear_qkv holds [q | k | v], each
    for all heads. With `conv1d`, HF stores linear weights as [in, out] (transposed).
    """

    variants: tuple[HFVariant, ...]  # export_variant picks one by the model's q/k/v biases and q/k norms
    config_keys: tuple[tuple[str, str], ...]  # (ModelConfig field, config.json key)
    check_config: Callable  # check_config(hf_cfg, variant): raise UnsupportedModelError naming the field
    prefix: str  # the backbone's prefix in *ForCausalLM / *ForSequenceClassification files
    layer: str  # a layer's prefix under the backbone, with {i}
    layer_modules: tuple[tuple[str, tuple[str, ...]], ...]  # (megatron module, HF module(s))
    embedding: str  # word embeddings, under the backbone
    final_norm: str  # under the backbone
    # (megatron module, HF module) of the per-head q/k norms: a layer's extra modules when ModelConfig.qk_layernorm
    qk_norm_modules: tuple[tuple[str, str], ...] = ()
    position_embedding: str | None = None  # learned positions, under the backbone
    lm_head: str = "lm_head"  # outside the backbone
    score_head: str = "score"  # the reward model's head, outside the backbone, no bias
    conv1d: bool = False
    export_extras: tuple[tuple[str, object], ...] = ()  # config.json entries for export beyond config_keys
    buffers: tuple[str, ...] = ()  # name suffixes of tensors HF files may carry that are not weights

    def variant_of_type(self, model_type: str) -> HFVariant | None:
        return next((v for v in self.variants if v.model_type == model_type), None)

    def variant_of_architecture(self, architecture: str) -> HFVariant | None:
        return next((v for v in self.variants if architecture in (v.causal_lm, v.classifier)), None)

    def export_variant(self, qkv_bias: bool, qk_layernorm: bool = False, nope: bool = False) -> HFVariant:
        """The variant to export a model as when no source config.json says which: the one with the model's q/k/v
        biases, q/k norms and layers without RoPE (Qwen2, Qwen3, SmolLM3); a family of one variant exports as it
        (GPT-2: biases everywhere)."""
        if len(self.variants) == 1:
            return self.variants[0]
        for v in self.variants:
            if (v.qkv_bias, v.qk_layernorm, v.nope) == (qkv_bias, qk_layernorm, nope):
                return v
        raise UnsupportedModelError(
            f"no Hugging Face model type of this family has q/k/v biases={qkv_bias} with q/k layernorm="
            f"{qk_layernorm} and layers without RoPE={nope} (known: {', '.join(v.model_type for v in self.variants)})"
        )


@dataclass(frozen=True)
class FamilySpec:
    """A model family's traits: what megatron builds, what the engine computes, how HF names it."""

    name: str  # ModelConfig.arch
    normalization: str  # RMSNorm | LayerNorm (with a bias)
    activation: str  # silu | gelu_tanh
    gated_mlp: bool  # fc1 is [gate; up] and the MLP computes act(gate) * up (SwiGLU with silu)
    linear_bias: bool  # every linear layer (qkv, proj, fc1, fc2) has a bias
    position_embedding: str  # rope | learned_absolute
    tie_embeddings: bool  # when an HF config does not say (tie_word_embeddings)
    hf: HFFormat
    rotary_interleaved: bool = False  # RoPE pairs: halves (rotate_half), not interleaved; see generation/native

    def __post_init__(self):
        for field, value, allowed in (
            ("normalization", self.normalization, NORMALIZATIONS),
            ("activation", self.activation, ACTIVATIONS),
            ("position_embedding", self.position_embedding, POSITION_EMBEDDINGS),
        ):
            if value not in allowed:
                raise ValueError(f"family {self.name!r}: {field}={value!r}, expected one of {allowed}")

    @property
    def norm_bias(self) -> bool:
        return self.normalization == "LayerNorm"

    @property
    def rope(self) -> bool:
        return self.position_embedding == "rope"

    def qkv_bias(self, cfg) -> bool:
        """Whether linear_qkv has a bias: always with linear biases, else as the ModelConfig says (Qwen2)."""
        return self.linear_bias or cfg.add_qkv_bias

    def activation_func(self) -> Callable:
        """The activation as a torch function, for megatron's TransformerConfig and the native engine alike."""
        import torch.nn.functional as F  # lazily: configs read specs without importing torch

        if self.activation == "silu":
            return F.silu
        return functools.partial(F.gelu, approximate="tanh")
