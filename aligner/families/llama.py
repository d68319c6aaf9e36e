"""The Llama family: Llama 2 and 3.x, Mistral, Qwen2 (q/k/v biases), Qwen3 dense (per-head q/k RMSNorm, an explicit
head_dim) and SmolLM3 (layers without RoPE: `nope_layers`).

RMSNorm, SwiGLU (fc1 = [gate; up]), RoPE (non-interleaved, over the whole head or, where the HF variant rotates part of
it, the share its config names; plain, with Llama 3.1's "llama3" frequency scaling or with LongRoPE's short factors,
as Phi-3.5 writes them), no biases except Qwen2's on q/k/v, untied embeddings unless the config says otherwise (Llama
3.2 1B/3B and small Qwen models tie them).
"""

from __future__ import annotations

from aligner.families.spec import (
    LLAMA3_ROPE_KEYS,
    FamilySpec,
    HFFormat,
    HFVariant,
    UnsupportedModelError,
    hf_get,
    hf_rope,
    longrope_numbers,
    nope_layers,
    partial_rotary_factor,
)

ROPE_TYPES = ("default", "llama3", "longrope")


def sliding_layers(hf_cfg, variant: HFVariant) -> int:
    """How many layers attend through a sliding window: Qwen2/Qwen3 list each layer's kind in 'layer_types'
    (windows from 'max_window_layers' on, when 'use_sliding_window'); Mistral and Phi-3 window every layer when
    'sliding_window' is set."""
    if hf_get(hf_cfg, "sliding_window") is None:
        return 0
    layer_types = hf_get(hf_cfg, "layer_types")
    if layer_types is not None:
        return sum(kind == "sliding_attention" for kind in layer_types)
    uses = hf_get(hf_cfg, "use_sliding_window", variant.window_every_layer)
    return hf_get(hf_cfg, "num_hidden_layers") if uses else 0


def check_hf_config(hf_cfg, variant: HFVariant) -> None:
    """Raise UnsupportedModelError naming the first config.json field megatron's Llama cannot express (the Phi-3
    family's check too: the same model with other tensor names)."""

    def unsupported(field, value, what):
        raise UnsupportedModelError(f"config.json '{field}' = {value!r}: {what}")

    act = hf_get(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, f"{variant.model_type} models are supported with SwiGLU (silu) only")
    if not variant.qkv_bias and hf_get(hf_cfg, "attention_bias", False):
        unsupported(
            "attention_bias", True, "biases on q/k/v/o projections are not supported (Qwen2's q/k/v-only biases are)"
        )
    if hf_get(hf_cfg, "mlp_bias", False):
        unsupported("mlp_bias", True, f"MLP biases are not supported for {variant.model_type} models")
    _, rope_type, params = hf_rope(hf_cfg)
    if rope_type not in ROPE_TYPES:
        unsupported(
            "rope_parameters.rope_type",
            rope_type,
            f"supported RoPE types are {', '.join(ROPE_TYPES)} (plain, Llama 3.1's and Phi-3.5's frequency scalings)",
        )
    if rope_type == "llama3":
        missing = [key for key, _ in LLAMA3_ROPE_KEYS if params.get(key) is None]
        if missing:
            unsupported("rope_parameters", params, f"a 'llama3' RoPE needs {', '.join(missing)}")
    if rope_type == "longrope":
        _check_longrope(hf_cfg, params, unsupported)
    if variant.nope:
        flags = hf_get(hf_cfg, "no_rope_layers")
        layers = hf_get(hf_cfg, "num_hidden_layers")
        if flags is not None and len(flags) < layers:
            unsupported("no_rope_layers", flags, f"needs one entry per layer (num_hidden_layers={layers})")
        if rope_type == "longrope" and nope_layers(hf_cfg):
            unsupported("no_rope_layers", flags, "layers without RoPE are not supported with a 'longrope' RoPE")
    partial = partial_rotary_factor(hf_cfg, params)
    if partial != 1.0 and not variant.partial_rotary:
        unsupported(
            "partial_rotary_factor", partial, f"{variant.model_type} models rotate the whole head (1.0) in HF as here"
        )
    layer_types = hf_get(hf_cfg, "layer_types") or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        unsupported("layer_types", other, "only full and sliding-window attention layers are supported")
    max_pos = hf_get(hf_cfg, "max_position_embeddings")
    window = hf_get(hf_cfg, "sliding_window")
    if sliding_layers(hf_cfg, variant) and window < max_pos:
        unsupported(
            "sliding_window",
            window,
            f"sliding-window attention shorter than max_position_embeddings={max_pos} is not supported; "
            f"pass --max-position-embeddings {window} to convert for sequences within the window "
            "(where full causal attention is exact)",
        )


def _check_longrope(hf_cfg, params: dict, unsupported) -> None:
    """LongRoPE within the pre-training context only: there HF rotates every position by the short factors (beyond it,
    by the long ones, from the first position on, once a sequence is longer), so positions capped at it are exact."""
    missing = [key for key in ("short_factor", "long_factor") if params.get(key) is None]
    original, _ = longrope_numbers(hf_cfg, params)
    if original is None:
        missing.append("original_max_position_embeddings")
    if missing:
        unsupported("rope_parameters", params, f"a 'longrope' RoPE needs {', '.join(missing)}")
    max_pos = hf_get(hf_cfg, "max_position_embeddings")
    if max_pos > original:
        unsupported(
            "max_position_embeddings",
            max_pos,
            f"LongRoPE beyond its pre-training context (original_max_position_embeddings={original}, where HF switches "
            f"to the long factors) is not supported; pass --max-position-embeddings {original} to convert for "
            "sequences within it (the short factors: exact)",
        )


LLAMA = FamilySpec(
    name="llama",
    normalization="RMSNorm",
    activation="silu",
    gated_mlp=True,
    linear_bias=False,
    position_embedding="rope",
    tie_embeddings=False,
    hf=HFFormat(
        variants=(
            HFVariant("llama", "LlamaForCausalLM", "LlamaForSequenceClassification", "LlamaConfig"),
            HFVariant(
                "mistral",
                "MistralForCausalLM",
                "MistralForSequenceClassification",
                "MistralConfig",
                window_every_layer=True,
            ),
            HFVariant("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Config", qkv_bias=True),
            HFVariant("qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification", "Qwen3Config", qk_layernorm=True),
            HFVariant("smollm3", "SmolLM3ForCausalLM", "SmolLM3ForSequenceClassification", "SmolLM3Config", nope=True),
        ),
        config_keys=(
            ("num_layers", "num_hidden_layers"),
            ("hidden_size", "hidden_size"),
            ("num_attention_heads", "num_attention_heads"),
            ("num_query_groups", "num_key_value_heads"),
            ("head_dim", "head_dim"),
            ("ffn_hidden_size", "intermediate_size"),
            ("vocab_size", "vocab_size"),
            ("max_position_embeddings", "max_position_embeddings"),
            ("norm_epsilon", "rms_norm_eps"),
            ("tie_embeddings", "tie_word_embeddings"),
            ("init_method_std", "initializer_range"),
        ),
        check_config=check_hf_config,
        prefix="model.",
        layer="layers.{i}.",
        layer_modules=(
            ("input_layernorm", ("input_layernorm",)),
            ("self_attention.linear_qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("self_attention.linear_proj", ("self_attn.o_proj",)),
            ("pre_mlp_layernorm", ("post_attention_layernorm",)),
            ("mlp.linear_fc1", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.linear_fc2", ("mlp.down_proj",)),
        ),
        qk_norm_modules=(
            ("self_attention.q_layernorm", "self_attn.q_norm"),
            ("self_attention.k_layernorm", "self_attn.k_norm"),
        ),
        embedding="embed_tokens",
        final_norm="norm",
        buffers=("rotary_emb.inv_freq",),
    ),
)
