"""Model families: one frozen `FamilySpec` per family, the one home of everything that differs between them.

`family(name)` returns the spec that `ModelConfig.arch` names (an unknown name raises ValueError listing the
known ones); `families()` lists them all. Code reads traits from the spec and never tests a family's name.

Contract, trait by trait (who reads what):
- normalization, activation / activation_func(), gated_mlp, linear_bias, qkv_bias(cfg), position_embedding,
  rotary_*: aligner.models.gpt (TransformerConfig, layer spec, GPTModel) and aligner.generation.native (the decoder
  and its fused kernels recompute megatron's forward from them);
- gated_mlp: also aligner.models.sharding (a gated fc1 is split over TP as [gate_r; up_r]);
- tie_embeddings: the default when an HF config omits tie_word_embeddings (aligner.checkpoint.hf);
- hf (HFFormat): aligner.checkpoint.hf and .convert. Its variants map HF architectures and model types onto the
  family (Mistral, Qwen2 and Qwen3 are Llama variants, told apart by config.json 'model_type'; a variant's q/k/v
  biases and q/k norms become ModelConfig.add_qkv_bias / qk_layernorm; Phi-3 is a family of its own: Llama's model
  under other tensor names); config_keys map ModelConfig fields to config.json keys both ways; check_config rejects
  what megatron cannot express; the tensor names and layouts drive the weight map.
Specs are pure data and import nothing above them (no torch, no aligner package), so the package sits at the
bottom of the house: aligner.config validates `ModelConfig.arch` against `names()`; torch dtypes live in
aligner.models.dtypes.

Adding a family: a module here defining its `FamilySpec`, registered in `_FAMILIES` below, plus its tests. A new
tensor layout (beyond fused q/k/v, [gate; up] and Conv1D) also needs its transform in aligner.checkpoint.hf.
"""

from __future__ import annotations

from aligner.families.gpt2 import GPT2
from aligner.families.llama import LLAMA
from aligner.families.phi3 import PHI3
from aligner.families.spec import FamilySpec, HFFormat, HFVariant, UnsupportedModelError

_FAMILIES = {spec.name: spec for spec in (LLAMA, PHI3, GPT2)}


def family(name: str) -> FamilySpec:
    """The spec of the family `name` (a ModelConfig.arch)."""
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}: known families are {', '.join(sorted(_FAMILIES))}") from None


def families() -> tuple[FamilySpec, ...]:
    return tuple(_FAMILIES.values())


def names() -> tuple[str, ...]:
    """The accepted values of `ModelConfig.arch`."""
    return tuple(sorted(_FAMILIES))


__all__ = ["FamilySpec", "HFFormat", "HFVariant", "UnsupportedModelError", "families", "family", "names"]
