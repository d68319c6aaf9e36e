"""The Phi-3 family (`Phi3ForCausalLM`): Phi-4 as released, Phi-3 mini/medium 4k within their window.

The model is the Llama family's (RMSNorm, SwiGLU, RoPE over the whole head, GQA, no biases); what differs is how HF
stores it: q, k and v as one `qkv_proj` tensor ([q | k | v], each for all heads) and the MLP's gate and up as one
`gate_up_proj` ([gate; up], megatron's own fc1 layout). A config.json 'sliding_window' windows every layer (Phi-3
mini/medium 4k: 2047; Phi-4: none), so the Llama check applies as it is. LongRoPE ('longrope', Phi-3 128k, Phi-3.5,
Phi-4-mini) and a partial rotary factor (Phi-4-mini: 0.75) are refused by that check, by name.
"""

from __future__ import annotations

from aligner.families.llama import LLAMA, check_hf_config
from aligner.families.spec import FamilySpec, HFFormat, HFVariant

PHI3 = FamilySpec(
    name="phi3",
    normalization=LLAMA.normalization,
    activation=LLAMA.activation,
    gated_mlp=LLAMA.gated_mlp,
    linear_bias=LLAMA.linear_bias,
    position_embedding=LLAMA.position_embedding,
    tie_embeddings=False,
    hf=HFFormat(
        variants=(
            HFVariant(
                "phi3", "Phi3ForCausalLM", "Phi3ForSequenceClassification", "Phi3Config", window_every_layer=True
            ),
        ),
        config_keys=LLAMA.hf.config_keys,
        check_config=check_hf_config,
        prefix="model.",
        layer="layers.{i}.",
        layer_modules=(
            ("input_layernorm", ("input_layernorm",)),
            ("self_attention.linear_qkv", ("self_attn.qkv_proj",)),
            ("self_attention.linear_proj", ("self_attn.o_proj",)),
            ("pre_mlp_layernorm", ("post_attention_layernorm",)),
            ("mlp.linear_fc1", ("mlp.gate_up_proj",)),
            ("mlp.linear_fc2", ("mlp.down_proj",)),
        ),
        embedding="embed_tokens",
        final_norm="norm",
        # Phi3Config's own token ids (bos 1, eos and pad 32000) fit only Phi-3's vocabulary; a model exported
        # without its source config.json takes its ids from the tokenizer files instead.
        export_extras=(("bos_token_id", None), ("eos_token_id", None), ("pad_token_id", None)),
        buffers=("rotary_emb.inv_freq",),
    ),
)
