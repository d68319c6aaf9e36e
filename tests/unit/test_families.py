"""The family registry and each family's traits; the one dtype map."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest
import torch
import torch.nn.functional as F

from aligner.checkpoint.hf import SUPPORTED
from aligner.config.schema import Dtype, ModelConfig, validate_model
from aligner.families import families, family
from aligner.models.dtypes import DTYPE_NAMES, torch_dtype

DTYPES = typing.get_args(Dtype)

# The megatron layer modules the HF weight map assembles; every family must say where each comes from in HF.
LAYER_MODULES = {
    "input_layernorm",
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "pre_mlp_layernorm",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
}


def test_an_unknown_family_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown model family 'bert': known families are gpt2, llama, phi3"):
        family("bert")


def test_the_registry_holds_each_spec_under_its_own_name():
    assert sorted(spec.name for spec in families()) == ["gpt2", "llama", "phi3"]
    assert all(family(spec.name) is spec for spec in families())


def test_llama_traits():
    spec = family("llama")
    assert (spec.normalization, spec.activation, spec.gated_mlp, spec.linear_bias) == ("RMSNorm", "silu", True, False)
    assert (spec.position_embedding, spec.rope) == ("rope", True)
    assert not spec.rotary_interleaved
    assert not spec.norm_bias and not spec.tie_embeddings
    assert not spec.qkv_bias(ModelConfig(arch="llama")) and spec.qkv_bias(ModelConfig(arch="llama", add_qkv_bias=True))
    hf = spec.hf
    assert (hf.prefix, hf.embedding, hf.final_norm, hf.position_embedding, hf.conv1d) == (
        "model.",
        "embed_tokens",
        "norm",
        None,
        False,
    )
    modules = dict(hf.layer_modules)
    assert modules["self_attention.linear_qkv"] == ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert modules["mlp.linear_fc1"] == ("mlp.gate_proj", "mlp.up_proj")  # [gate; up]


def test_phi3_is_llamas_model_under_fused_tensor_names():
    spec, llama = family("phi3"), family("llama")
    traits = ("normalization", "activation", "gated_mlp", "linear_bias", "position_embedding", "rotary_interleaved")
    assert all(getattr(spec, t) == getattr(llama, t) for t in traits) and not spec.tie_embeddings
    modules = dict(spec.hf.layer_modules)
    assert modules["self_attention.linear_qkv"] == ("self_attn.qkv_proj",)  # one [q | k | v]
    assert modules["mlp.linear_fc1"] == ("mlp.gate_up_proj",)  # one [gate; up], megatron's own layout
    assert not spec.hf.conv1d and not spec.hf.qk_norm_modules
    (variant,) = spec.hf.variants
    assert (variant.model_type, variant.causal_lm, variant.window_every_layer) == ("phi3", "Phi3ForCausalLM", True)
    assert spec.hf.export_variant(qkv_bias=False) is variant


def test_gpt2_traits():
    spec = family("gpt2")
    assert (spec.normalization, spec.activation, spec.gated_mlp, spec.linear_bias) == (
        "LayerNorm",
        "gelu_tanh",
        False,
        True,
    )
    assert (spec.position_embedding, spec.rope) == ("learned_absolute", False)
    assert spec.norm_bias and spec.tie_embeddings
    assert spec.qkv_bias(ModelConfig(arch="gpt2", add_qkv_bias=False))  # every linear layer has a bias
    hf = spec.hf
    assert (hf.prefix, hf.embedding, hf.final_norm, hf.position_embedding, hf.conv1d) == (
        "transformer.",
        "wte",
        "ln_f",
        "wpe",
        True,
    )
    assert dict(hf.layer_modules)["self_attention.linear_qkv"] == ("attn.c_attn",)  # one [q | k | v]
    assert dict(hf.config_keys)["hidden_size"] == "n_embd"


def test_activation_funcs_are_silu_and_the_tanh_gelu():
    x = torch.linspace(-3, 3, 13)
    assert torch.allclose(family("llama").activation_func()(x), x * torch.sigmoid(x))
    gelu = family("gpt2").activation_func()(x)
    assert torch.equal(gelu, F.gelu(x, approximate="tanh"))
    assert not torch.equal(gelu, F.gelu(x))  # not the erf GELU


def test_hf_variants_tell_llama_mistral_qwen2_and_qwen3_apart():
    from aligner.families import UnsupportedModelError

    hf = family("llama").hf
    assert hf.variant_of_type("qwen2").qkv_bias and not hf.variant_of_type("mistral").qkv_bias
    assert hf.variant_of_type("qwen3").qk_layernorm and not hf.variant_of_type("qwen3").qkv_bias
    assert hf.variant_of_type("qwen3_moe") is None
    assert hf.variant_of_architecture("MistralForSequenceClassification").model_type == "mistral"
    assert hf.export_variant(qkv_bias=True).causal_lm == "Qwen2ForCausalLM"
    assert hf.export_variant(qkv_bias=False).causal_lm == "LlamaForCausalLM"
    assert hf.export_variant(qkv_bias=False, qk_layernorm=True).causal_lm == "Qwen3ForCausalLM"
    assert hf.export_variant(qkv_bias=False, nope=True).causal_lm == "SmolLM3ForCausalLM"
    with pytest.raises(UnsupportedModelError, match="q/k/v biases=True with q/k layernorm=True"):
        hf.export_variant(qkv_bias=True, qk_layernorm=True)
    assert family("gpt2").hf.export_variant(qkv_bias=True).causal_lm == "GPT2LMHeadModel"  # its only variant
    assert dict(hf.qk_norm_modules) == {
        "self_attention.q_layernorm": "self_attn.q_norm",
        "self_attention.k_layernorm": "self_attn.k_norm",
    }


def test_supported_architectures_are_the_specs_variants():
    assert SUPPORTED == {
        "LlamaForCausalLM": ("llama", "policy"),
        "MistralForCausalLM": ("llama", "policy"),
        "Qwen2ForCausalLM": ("llama", "policy"),
        "Qwen3ForCausalLM": ("llama", "policy"),
        "SmolLM3ForCausalLM": ("llama", "policy"),
        "Phi3ForCausalLM": ("phi3", "policy"),
        "GPT2LMHeadModel": ("gpt2", "policy"),
        "LlamaForSequenceClassification": ("llama", "reward"),
        "MistralForSequenceClassification": ("llama", "reward"),
        "Qwen2ForSequenceClassification": ("llama", "reward"),
        "Qwen3ForSequenceClassification": ("llama", "reward"),
        "SmolLM3ForSequenceClassification": ("llama", "reward"),
        "Phi3ForSequenceClassification": ("phi3", "reward"),
        "GPT2ForSequenceClassification": ("gpt2", "reward"),
    }


@pytest.mark.parametrize("name", ["llama", "phi3", "gpt2"])
def test_each_family_names_every_layer_module_and_the_config_fields(name):
    hf = family(name).hf
    assert {m for m, _ in hf.layer_modules} == LAYER_MODULES
    fields = {f for f, _ in hf.config_keys}
    assert fields <= {f.name for f in dataclasses.fields(ModelConfig)}
    needed = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "vocab_size"}
    needed |= {"max_position_embeddings", "norm_epsilon", "tie_embeddings", "init_method_std"}
    assert needed <= fields


def test_every_family_passes_config_validation():
    # aligner.config accepts exactly the registered names.
    for spec in families():
        validate_model(ModelConfig(arch=spec.name))


def test_a_spec_rejects_an_unknown_trait():
    with pytest.raises(ValueError, match="normalization='BatchNorm'"):
        dataclasses.replace(family("llama"), normalization="BatchNorm")


def test_specs_import_without_torch():
    # aligner.config reaches the specs through the generation config and must stay torch-free.
    code = "import sys, aligner.families; assert 'torch' not in sys.modules, 'torch imported'"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_one_dtype_map_over_the_config_names():
    assert [torch_dtype(name) for name in DTYPES] == [torch.float32, torch.bfloat16, torch.float16]
    assert [DTYPE_NAMES[torch_dtype(name)] for name in DTYPES] == list(DTYPES)
    with pytest.raises(ValueError, match="'fp8'.*float32, bfloat16, float16"):
        torch_dtype("fp8")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_the_megatron_config_reads_the_family(name):
    from dist import free_port

    from aligner.models.gpt import transformer_config
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    spec = family(name)
    cfg = ModelConfig(arch=name, params_dtype="bfloat16")
    tc = transformer_config(cfg)
    assert (tc.normalization, tc.gated_linear_unit, tc.add_bias_linear) == (
        spec.normalization,
        spec.gated_mlp,
        spec.linear_bias,
    )
    assert tc.add_qkv_bias == spec.qkv_bias(cfg) and tc.params_dtype == torch.bfloat16
    assert (tc.kv_channels, tc.qk_layernorm) == (16, False)
    if spec.rope:  # Qwen3's shape: a head width of its own, q/k norms
        tc = transformer_config(ModelConfig(arch=name, head_dim=24, qk_layernorm=True))
        assert (tc.kv_channels, tc.qk_layernorm) == (24, True)
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(tc.activation_func(x), spec.activation_func()(x))
