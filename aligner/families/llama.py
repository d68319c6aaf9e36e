"""The Llama family: Llama 2/3, Mistral, and Qwen2 (q/k/v biases).

RMSNorm, SwiGLU (fc1 = [gate; up]), RoPE (non-interleaved, whole head), no biases except Qwen2's on q/k/v,
untied embeddings unless the config says otherwise.
"""

from __future__ import annotations

from aligner.families.spec import FamilySpec, HFFormat, HFVariant, UnsupportedModelError, hf_get, hf_rope


def check_hf_config(hf_cfg, variant: HFVariant) -> None:
    """Raise UnsupportedModelError naming the first config.json field megatron's Llama cannot express."""

    def unsupported(field, value, what):
        raise UnsupportedModelError(f"config.json '{field}' = {value!r}: {what}")

    act = hf_get(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "the Llama family is supported with SwiGLU (silu) only")
    hidden, heads = hf_get(hf_cfg, "hidden_size"), hf_get(hf_cfg, "num_attention_heads")
    head_dim = hf_get(hf_cfg, "head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        unsupported(
            "head_dim", head_dim, f"only head_dim = hidden_size / num_attention_heads = {hidden // heads} is supported"
        )
    if not variant.qkv_bias and hf_get(hf_cfg, "attention_bias", False):
        unsupported(
            "attention_bias", True, "biases on q/k/v/o projections are not supported (Qwen2's q/k/v-only biases are)"
        )
    if hf_get(hf_cfg, "mlp_bias", False):
        unsupported("mlp_bias", True, "MLP biases are not supported in the Llama family")
    _, rope_type = hf_rope(hf_cfg)
    if rope_type != "default":
        unsupported("rope_parameters.rope_type", rope_type, "only unscaled RoPE ('default') is supported")
    max_pos = hf_get(hf_cfg, "max_position_embeddings")
    window = hf_get(hf_cfg, "sliding_window")
    uses_window = hf_get(hf_cfg, "use_sliding_window", variant.model_type == "mistral")
    if uses_window and window is not None and window < max_pos:
        unsupported(
            "sliding_window",
            window,
            f"sliding-window attention shorter than max_position_embeddings={max_pos} is not supported; "
            f"pass --max-position-embeddings {window} to convert for sequences within the window "
            "(where full causal attention is exact)",
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
            HFVariant("mistral", "MistralForCausalLM", "MistralForSequenceClassification", "MistralConfig"),
            HFVariant("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification", "Qwen2Config", qkv_bias=True),
        ),
        config_keys=(
            ("num_layers", "num_hidden_layers"),
            ("hidden_size", "hidden_size"),
            ("num_attention_heads", "num_attention_heads"),
            ("num_query_groups", "num_key_value_heads"),
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
        embedding="embed_tokens",
        final_norm="norm",
        buffers=("rotary_emb.inv_freq",),
    ),
)
