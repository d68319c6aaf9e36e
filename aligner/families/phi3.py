"""The Phi-3 family (`Phi3ForCausalLM`): Phi-4 as released, Phi-3 mini/medium 4k within their window, Phi-3.5 mini,
Phi-3 128k and Phi-4-mini within their pre-training context.

The model is the Llama family's (RMSNorm, SwiGLU, RoPE, GQA, no biases); what differs is how HF
stores it: q, k and v as one `qkv_proj` tensor ([q | k | v], each for all heads) and the MLP's gate and up as one
`gate_up_proj` ([gate; up], megatron's own fc1 layout). A config.json 'sliding_window' windows every layer (Phi-3
mini/medium 4k: 2047; Phi-4: none), so the Llama check applies as it is. So does its LongRoPE ('longrope', Phi-3
128k, Phi-3.5, Phi-4-mini): accepted within the pre-training context (aligner.models.rope). Unlike Llama's, HF's
Phi-3 model rotates the share of each head a partial rotary factor says (Phi-4-mini: 0.75): `partial_rotary`.
"""

from __future__ import annotations

import dataclasses

from aligner.families.llama import LLAMA
from aligner.families.spec import HFVariant

# the megatron modules HF's Phi-3 stores as one tensor each (Llama: three and two)
FUSED = {"self_attention.linear_qkv": ("self_attn.qkv_proj",), "mlp.linear_fc1": ("mlp.gate_up_proj",)}
_VARIANT = HFVariant(
    "phi3",
    "Phi3ForCausalLM",
    "Phi3ForSequenceClassification",
    "Phi3Config",
    window_every_layer=True,
    partial_rotary=True,
)

# Llama's spec with the family's name and HF format changed: its traits, config keys, check and other names kept.
PHI3 = dataclasses.replace(
    LLAMA,
    name="phi3",
    hf=dataclasses.replace(
        LLAMA.hf,
        variants=(_VARIANT,),
        layer_modules=tuple((module, FUSED.get(module, names)) for module, names in LLAMA.hf.layer_modules),
        qk_norm_modules=(),
        # Phi3Config's own token ids (bos 1, eos and pad 32000) fit only Phi-3's vocabulary; a model exported
        # without its source config.json takes its ids from the tokenizer files instead.
        export_extras=(("bos_token_id", None), ("eos_token_id", None), ("pad_token_id", None)),
    ),
)
