"""The GPT-2 family: LayerNorm, GELU (tanh approximation), learned absolute positions, biases on every linear layer,
tied embeddings unless the config says otherwise. HF stores its linear weights as Conv1D ([in, out])."""

from __future__ import annotations

from aligner.families.spec import FamilySpec, HFFormat, HFVariant, UnsupportedModelError, hf_get

HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation megatron's GPT-2 uses


def check_hf_config(hf_cfg, variant: HFVariant) -> None:
    """Raise UnsupportedModelError naming the first config.json field megatron's GPT-2 cannot express."""
    act = hf_get(hf_cfg, "activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise UnsupportedModelError(
            f"config.json 'activation_function' = {act!r}: GPT-2 is supported with the tanh "
            f"GELU ({', '.join(HF_ACTIVATIONS)})"
        )
    for field, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(hf_get(hf_cfg, field, ok)) != ok:
            raise UnsupportedModelError(f"config.json '{field}' = {hf_get(hf_cfg, field)!r}: only {ok} is supported")


GPT2 = FamilySpec(
    name="gpt2",
    normalization="LayerNorm",
    activation="gelu_tanh",
    gated_mlp=False,
    linear_bias=True,
    position_embedding="learned_absolute",
    tie_embeddings=True,
    hf=HFFormat(
        variants=(HFVariant("gpt2", "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2Config"),),
        config_keys=(
            ("num_layers", "n_layer"),
            ("hidden_size", "n_embd"),
            ("num_attention_heads", "n_head"),
            ("ffn_hidden_size", "n_inner"),
            ("vocab_size", "vocab_size"),
            ("max_position_embeddings", "n_positions"),
            ("norm_epsilon", "layer_norm_epsilon"),
            ("tie_embeddings", "tie_word_embeddings"),
            ("init_method_std", "initializer_range"),
        ),
        check_config=check_hf_config,
        prefix="transformer.",
        layer="h.{i}.",
        layer_modules=(
            ("input_layernorm", ("ln_1",)),
            ("self_attention.linear_qkv", ("attn.c_attn",)),
            ("self_attention.linear_proj", ("attn.c_proj",)),
            ("pre_mlp_layernorm", ("ln_2",)),
            ("mlp.linear_fc1", ("mlp.c_fc",)),
            ("mlp.linear_fc2", ("mlp.c_proj",)),
        ),
        embedding="wte",
        position_embedding="wpe",
        final_norm="ln_f",
        conv1d=True,
        export_extras=(("activation_function", "gelu_new"),),
        buffers=("attn.bias", "attn.masked_bias"),
    ),
)
