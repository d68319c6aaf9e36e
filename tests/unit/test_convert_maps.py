"""HF <-> megatron maps without a model: layouts by hand, exact inverses, config checks and their messages, files."""

import json
import math
import os

import pytest
import torch

from aligner.checkpoint.hf import (
    CheckpointMismatchError,
    UnsupportedModelError,
    detect_prefix,
    hf_config_for_export,
    model_config_from_hf,
    normalized_hf_config,
    weight_map,
)
from aligner.checkpoint.hf_io import HFReader, SafetensorsWriter, parse_size
from aligner.config.schema import ModelConfig

LLAMA = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=12,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)


def _random_hf(wmap, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, shape in wmap.all_hf_shapes().items()}


def _round_trip(wmap, hf):
    meg = {}
    for part in wmap.parts():
        meg.update(wmap.to_megatron(part, hf.__getitem__))
    back = {}
    for part in wmap.parts():
        back.update(wmap.to_hf(part, meg.__getitem__))
    return meg, back


def test_llama_fused_qkv_is_grouped_per_kv_head():
    # 4 query heads, 2 KV groups, head_dim 1 (hidden 4): megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    cfg = ModelConfig(
        arch="llama",
        num_layers=1,
        hidden_size=4,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=2,
        vocab_size=3,
        add_qkv_bias=True,
    )
    wmap = weight_map(cfg, "policy")
    hf = {n: torch.zeros(s) for n, s in wmap.hf_shapes(0).items()}
    q = torch.tensor([10.0, 11, 12, 13])
    k, v = torch.tensor([20.0, 21]), torch.tensor([30.0, 31])
    for p, t in zip("qkv", (q, k, v)):
        hf[f"model.layers.0.self_attn.{p}_proj.bias"] = t
        hf[f"model.layers.0.self_attn.{p}_proj.weight"] = t[:, None].expand(-1, 4)
    hf["model.layers.0.mlp.gate_proj.weight"] = torch.ones(2, 4)
    hf["model.layers.0.mlp.up_proj.weight"] = 2 * torch.ones(2, 4)
    meg = wmap.to_megatron(0, hf.__getitem__)
    expected = [10.0, 11, 20, 30, 12, 13, 21, 31]
    assert meg["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == expected
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == expected
    assert meg["decoder.layers.0.mlp.linear_fc1.weight"][:, 0].tolist() == [1, 1, 2, 2]  # [gate; up]


def test_gpt2_conv1d_qkv_becomes_per_head_rows():
    # GPT-2 c_attn: Conv1D [in=h, out=3h], columns [q | k | v]; megatron rows per head [q_h; k_h; v_h].
    cfg = ModelConfig(
        arch="gpt2", num_layers=1, hidden_size=4, num_attention_heads=2, vocab_size=3, max_position_embeddings=8
    )
    wmap = weight_map(cfg, "policy")
    hf = {n: torch.zeros(s) for n, s in wmap.hf_shapes(0).items()}
    cols = torch.arange(12.0)  # q = 0..3 (head0: 0,1; head1: 2,3), k = 4..7, v = 8..11
    hf["transformer.h.0.attn.c_attn.weight"] = cols[None, :].expand(4, -1)
    hf["transformer.h.0.attn.c_attn.bias"] = cols
    hf["transformer.h.0.mlp.c_fc.weight"] = torch.arange(16.0).reshape(4, 4)
    meg = wmap.to_megatron(0, hf.__getitem__)
    expected = [0.0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    assert meg["decoder.layers.0.self_attention.linear_qkv.bias"].tolist() == expected
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"][:, 0].tolist() == expected
    assert torch.equal(meg["decoder.layers.0.mlp.linear_fc1.weight"], torch.arange(16.0).reshape(4, 4).t())


@pytest.mark.parametrize(
    "arch,kw,model_type",
    [
        ("llama", dict(num_query_groups=2, add_qkv_bias=True), "policy"),
        ("llama", dict(num_query_groups=1, tie_embeddings=True), "policy"),
        ("llama", dict(num_query_groups=4), "reward"),
        ("llama", dict(num_query_groups=2, head_dim=6, qk_layernorm=True), "policy"),  # Qwen3: q is [24, 16]
        ("llama", dict(num_query_groups=2, head_dim=6, qk_layernorm=True, tie_embeddings=True), "reward"),
        ("gpt2", dict(), "policy"),
        ("gpt2", dict(tie_embeddings=False), "reward"),
    ],
)
def test_maps_are_exact_inverses(arch, kw, model_type):
    cfg = ModelConfig(
        arch=arch,
        num_layers=2,
        hidden_size=16,
        num_attention_heads=4,
        ffn_hidden_size=24,
        vocab_size=11,
        max_position_embeddings=8,
        **kw,
    )
    wmap = weight_map(cfg, model_type)
    hf = _random_hf(wmap)
    meg, back = _round_trip(wmap, hf)
    assert sorted(back) == sorted(hf)
    for name in hf:
        assert torch.equal(back[name], hf[name]), name
    if cfg.qk_layernorm:
        assert meg["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (6,)
        assert torch.equal(
            meg["decoder.layers.1.self_attention.k_layernorm.weight"], hf["model.layers.1.self_attn.k_norm.weight"]
        )
        assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 6, 16)
        assert meg["decoder.layers.0.self_attention.linear_proj.weight"].shape == (16, 24)
    if model_type == "reward":
        assert meg["output_layer.weight"].shape == (1, 16) and meg["output_layer.bias"].tolist() == [0.0]
    assert ("output_layer.weight" in meg) == (model_type == "reward" or not cfg.tie_embeddings)


def test_model_config_from_llama_family():
    cfg, family, model_type = model_config_from_hf(normalized_hf_config(LLAMA), "bfloat16")
    assert (family, model_type) == ("llama", "policy")
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_query_groups,
        cfg.ffn_hidden_size,
        cfg.vocab_size,
        cfg.rotary_base,
        cfg.norm_epsilon,
        cfg.params_dtype,
        cfg.add_qkv_bias,
    ) == (2, 8, 4, 2, 12, 10, 500000.0, 1e-6, "bfloat16", False)
    qwen = dict(LLAMA, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True)
    cfg, _, _ = model_config_from_hf(normalized_hf_config(qwen))
    assert cfg.add_qkv_bias and cfg.tie_embeddings
    legacy = {k: v for k, v in LLAMA.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1234.0, rope_scaling=None)  # transformers 4 spelling
    assert model_config_from_hf(normalized_hf_config(legacy))[0].rotary_base == 1234.0


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 5e5,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
QWEN3 = dict(LLAMA, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=6, tie_word_embeddings=True)


def test_model_config_from_llama3_and_qwen3():
    llama3 = dict(LLAMA, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True)  # Llama 3.2 1B/3B
    cfg, _, _ = model_config_from_hf(normalized_hf_config(llama3))
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor) == ("llama3", 32.0, 1.0)
    assert (cfg.rope_scaling_high_freq_factor, cfg.rope_scaling_original_max_position_embeddings) == (4.0, 16)
    assert cfg.tie_embeddings and cfg.head_dim is None and not cfg.qk_layernorm and cfg.rotary_base == 5e5
    built = hf_config_for_export(cfg, "policy", None, "float32")  # no source: from model.yaml alone
    assert built["architectures"] == ["LlamaForCausalLM"] and built["rope_parameters"]["factor"] == 32.0
    assert model_config_from_hf(normalized_hf_config(built))[0] == cfg

    cfg, _, _ = model_config_from_hf(normalized_hf_config(QWEN3))
    assert (cfg.qk_layernorm, cfg.head_dim, cfg.kv_channels, cfg.add_qkv_bias) == (True, 6, 6, False)
    assert cfg.rope_scaling is None
    built = hf_config_for_export(cfg, "reward", None, "float32")
    assert built["architectures"] == ["Qwen3ForSequenceClassification"] and built["head_dim"] == 6
    assert model_config_from_hf(normalized_hf_config(built))[0] == cfg
    same = dict(LLAMA, head_dim=2)  # hidden / heads: the default width, left out of model.yaml
    assert model_config_from_hf(normalized_hf_config(same))[0].head_dim is None


@pytest.mark.parametrize(
    "change,field",
    [
        (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe"), "architecture 'Qwen3MoeForCausalLM'"),
        (dict(architectures=["MixtralForCausalLM"], model_type="mixtral"), "architecture 'MixtralForCausalLM'"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0}), "rope_type' = 'yarn'"),
        (dict(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}), "rope_type' = 'linear'"),
        (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 5e5, "factor": 2.0}), "rope_type' = 'dynamic'"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}),
            "'partial_rotary_factor'",
        ),
        (dict(attention_bias=True), "'attention_bias'"),
        (dict(QWEN3, attention_bias=True), "'attention_bias'"),  # Qwen3's: on q, k, v and o
        (dict(mlp_bias=True), "'mlp_bias'"),
        (dict(hidden_act="gelu"), "'hidden_act'"),
        (
            dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16),
            "--max-position-embeddings",
        ),
        (  # Qwen2 windows its layers from max_window_layers on: layer 1 of 2 here
            dict(
                architectures=["Qwen2ForCausalLM"],
                model_type="qwen2",
                use_sliding_window=True,
                sliding_window=16,
                max_window_layers=1,
            ),
            "'sliding_window' = 16",
        ),
        (dict(architectures=["LlamaForSequenceClassification"], id2label={"0": "a", "1": "b"}), "num_labels=2"),
        (dict(architectures=["LlamaForCausalLM", "LlamaModel"]), "exactly one"),
    ],
)
def test_unsupported_llama_features_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        model_config_from_hf(normalized_hf_config(dict(LLAMA, **change)))


def test_sliding_window_can_be_capped_and_covers_long_windows():
    mistral = dict(LLAMA, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    cfg, _, _ = model_config_from_hf(normalized_hf_config(mistral), max_position_embeddings=16)
    assert cfg.max_position_embeddings == 16
    long_window = dict(mistral, sliding_window=32)  # as long as the context: plain causal attention
    assert model_config_from_hf(normalized_hf_config(long_window))[0].max_position_embeddings == 32
    # Qwen2/Qwen3 with use_sliding_window but max_window_layers >= num_layers: no layer uses the window
    for model_type in ("qwen2", "qwen3"):
        unused = dict(
            LLAMA,
            architectures=[f"{model_type.capitalize()}ForCausalLM"],
            model_type=model_type,
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=2,
        )
        assert model_config_from_hf(normalized_hf_config(unused))[0].max_position_embeddings == 32


PHI3 = dict(LLAMA, architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0)


def test_phi3_configs_as_released():
    # Phi-4: no window, no RoPE scaling: converted whole
    cfg, family, model_type = model_config_from_hf(normalized_hf_config(dict(PHI3, sliding_window=None)))
    assert (family, model_type, cfg.arch, cfg.rope_scaling, cfg.head_dim) == ("phi3", "policy", "phi3", None, None)
    assert (cfg.num_query_groups, cfg.ffn_hidden_size, cfg.rotary_base, cfg.max_position_embeddings) == (2, 12, 5e5, 32)
    built = hf_config_for_export(cfg, "policy", None, "float32")  # no source: from model.yaml alone
    assert built["architectures"] == ["Phi3ForCausalLM"] and built["model_type"] == "phi3"
    assert (built["bos_token_id"], built["eos_token_id"], built["pad_token_id"]) == (None, None, None)
    assert model_config_from_hf(normalized_hf_config(built))[0] == cfg
    # Phi-3 mini / medium 4k: a window on every layer, shorter than the context: refused, exact under the cap
    windowed = dict(PHI3, sliding_window=15)
    with pytest.raises(UnsupportedModelError, match="'sliding_window' = 15.*--max-position-embeddings 15"):
        model_config_from_hf(normalized_hf_config(windowed))
    assert model_config_from_hf(normalized_hf_config(windowed), max_position_embeddings=15)[0].arch == "phi3"
    # Phi-3 128k, Phi-3.5: LongRoPE, its pre-training context (16) at the top level as they write it, 32 positions
    longrope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.5], "long_factor": [3.0]}
    phi35 = normalized_hf_config(dict(PHI3, rope_scaling=longrope, original_max_position_embeddings=16))
    with pytest.raises(
        UnsupportedModelError, match="original_max_position_embeddings=16.*--max-position-embeddings 16"
    ):
        model_config_from_hf(phi35)
    cfg, _, _ = model_config_from_hf(phi35, max_position_embeddings=16)
    assert (cfg.rope_scaling, cfg.rope_scaling_short_factor, cfg.rope_scaling_long_factor) == ("longrope", [1.5], [3.0])
    assert cfg.rope_scaling_original_max_position_embeddings == cfg.max_position_embeddings == 16
    assert cfg.rope_scaling_attention_factor == pytest.approx(1.25**0.5, rel=1e-12)  # sqrt(1 + ln(32/16) / ln 16)
    built = hf_config_for_export(cfg, "policy", None, "float32")  # no source: 16 positions, the factor written out
    assert built["max_position_embeddings"] == 16 and built["rope_parameters"]["attention_factor"] == 1.25**0.5
    assert model_config_from_hf(normalized_hf_config(built))[0] == cfg
    # transformers' own LongRoPE on the exported config: our frequencies and attention factor, bit for bit
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from aligner.models.rope import rope_inv_freq, softmax_scale

    theirs, factor = ROPE_INIT_FUNCTIONS["longrope"](Phi3Config(**built), "cpu", seq_len=16)
    assert torch.equal(rope_inv_freq(cfg), theirs) and factor == cfg.rope_scaling_attention_factor
    assert softmax_scale(cfg) == pytest.approx(1.25 / 2**0.5, rel=1e-12)  # a^2 / sqrt(head width 2)
    # transformers 4's name for it (Phi-3 128k's first config.json files)
    legacy = normalized_hf_config(
        dict(PHI3, rope_scaling={**longrope, "type": "su"}, original_max_position_embeddings=16)
    )
    assert model_config_from_hf(legacy, max_position_embeddings=16)[0] == cfg
    # a given attention factor or factor is HF's, as written
    for extra, expected in (
        ({"attention_factor": 1.1}, 1.1),
        ({"factor": 4.0}, (1 + math.log(4) / math.log(16)) ** 0.5),
    ):
        raw = dict(PHI3, rope_parameters={**longrope, **extra}, original_max_position_embeddings=16)
        cfg = model_config_from_hf(normalized_hf_config(raw), max_position_embeddings=16)[0]
        assert cfg.rope_scaling_attention_factor == pytest.approx(expected, rel=1e-12)
    # a config transformers itself rejects (one factor per rotated pair: 1 here) is one error, not its traceback
    broken = dict(longrope, short_factor=[1.0, 1.0])
    rejected = r"\(model_type 'phi3'\) is rejected by transformers: .*short_factor"
    with pytest.raises(UnsupportedModelError, match=rejected):
        normalized_hf_config(dict(PHI3, rope_parameters=broken))
    # Phi-4-mini rotates 3/4 of each head (here: 1 pair of a head of 4 channels, with LongRoPE), as its config.json
    # says at the top level; Llama's HF model has no partial rotation: refused there by name
    # (a rope dict of its own: transformers fills in the one it is given, partial_rotary_factor 1.0 included)
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.5], "long_factor": [3.0]}
    phi4mini = dict(PHI3, hidden_size=16, rope_scaling=rope, original_max_position_embeddings=16)
    cfg, _, _ = model_config_from_hf(normalized_hf_config(dict(phi4mini, partial_rotary_factor=0.5)), "float32", 16)
    assert (cfg.rotary_percent, cfg.kv_channels, cfg.rope_scaling_short_factor) == (0.5, 4, [1.5])
    built = hf_config_for_export(cfg, "policy", None, "float32")
    assert built["partial_rotary_factor"] == built["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert model_config_from_hf(normalized_hf_config(built))[0] == cfg
    theirs, _ = ROPE_INIT_FUNCTIONS["longrope"](Phi3Config(**built), "cpu", seq_len=16)
    assert torch.equal(rope_inv_freq(cfg), theirs)  # the rotated width's frequencies (2 of 4 channels: 1)
    partial = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    with pytest.raises(UnsupportedModelError, match="'partial_rotary_factor' = 0.5: llama models rotate the whole"):
        model_config_from_hf(normalized_hf_config(dict(LLAMA, rope_parameters=partial)))


def test_smollm3_configs_as_released():
    """SmolLM3: Llama's model with RoPE left out of the layers config.json's 'no_rope_layers' marks 0, or of every
    'no_rope_layer_interval'-th layer (default 4) where the list is absent; a sliding window on those is refused."""
    smollm3 = dict(LLAMA, architectures=["SmolLM3ForCausalLM"], model_type="smollm3", num_hidden_layers=8)
    for raw, nope in (
        (smollm3, [3, 7]),  # transformers' default: every 4th layer
        (dict(smollm3, no_rope_layer_interval=3), [2, 5]),
        (dict(smollm3, no_rope_layers=[1, 0, 1, 1, 0, 0, 1, 1]), [1, 4, 5]),
    ):
        assert model_config_from_hf(raw)[0].nope_layers == nope  # as the file says (no transformers defaults)
        cfg, family, _ = model_config_from_hf(normalized_hf_config(raw))
        assert (family, cfg.nope_layers) == ("llama", nope)
        built = hf_config_for_export(cfg, "policy", None, "float32")  # no source: from model.yaml alone
        assert built["architectures"] == ["SmolLM3ForCausalLM"] and built["model_type"] == "smollm3"
        assert [i for i, rope in enumerate(built["no_rope_layers"]) if not rope] == nope
        assert model_config_from_hf(normalized_hf_config(built))[0] == cfg
        assert hf_config_for_export(cfg, "reward", None, "float32")["architectures"] == [
            "SmolLM3ForSequenceClassification"
        ]
    with pytest.raises(UnsupportedModelError, match="'no_rope_layers' = \\[1, 0\\]: needs one entry per layer"):
        model_config_from_hf(dict(smollm3, no_rope_layers=[1, 0]))
    windowed = normalized_hf_config(dict(smollm3, use_sliding_window=True, sliding_window=16))
    with pytest.raises(UnsupportedModelError, match="'sliding_window' = 16.*--max-position-embeddings 16"):
        model_config_from_hf(windowed)
    # a model.yaml with layers without RoPE does not export onto a Llama's config.json (nor back)
    cfg = model_config_from_hf(normalized_hf_config(smollm3))[0]
    with pytest.raises(CheckpointMismatchError, match="nope_layers=\\[\\] but model.yaml has \\[3, 7\\]"):
        hf_config_for_export(cfg, "policy", normalized_hf_config(dict(LLAMA, num_hidden_layers=8)), "float32")


def test_unsupported_gpt2_features():
    gpt2 = dict(
        architectures=["GPT2LMHeadModel"],
        model_type="gpt2",
        vocab_size=10,
        n_embd=8,
        n_layer=1,
        n_head=2,
        n_positions=16,
    )
    assert model_config_from_hf(normalized_hf_config(gpt2))[0].tie_embeddings
    for change, field in (
        (dict(activation_function="gelu"), "activation_function"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ):
        with pytest.raises(UnsupportedModelError, match=field):
            model_config_from_hf(normalized_hf_config(dict(gpt2, **change)))


def test_export_config_switches_head_and_checks_agreement():
    cfg, _, _ = model_config_from_hf(normalized_hf_config(LLAMA))
    reward = hf_config_for_export(cfg, "reward", LLAMA, "float32")
    assert reward["architectures"] == ["LlamaForSequenceClassification"] and reward["id2label"] == {"0": "LABEL_0"}
    assert hf_config_for_export(cfg, "policy", reward, "bfloat16")["architectures"] == ["LlamaForCausalLM"]
    built = hf_config_for_export(cfg, "policy", None, "float32")  # no source config: built from model.yaml
    again, _, _ = model_config_from_hf(normalized_hf_config(built))
    assert again == cfg
    cfg.num_layers = 3
    with pytest.raises(CheckpointMismatchError, match="num_layers"):
        hf_config_for_export(cfg, "policy", LLAMA, "float32")


def test_detect_prefix():
    assert detect_prefix("llama", ["model.embed_tokens.weight"]) == "model."
    assert detect_prefix("gpt2", ["wte.weight", "h.0.ln_1.weight"]) == ""
    with pytest.raises(CheckpointMismatchError, match="no embedding"):
        detect_prefix("llama", ["transformer.wte.weight"])


def test_safetensors_writer_shards_and_reader_reads_back(tmp_path):
    tensors = {f"t{i}": torch.full((10, 10), float(i)) for i in range(5)}  # 400 bytes each
    writer = SafetensorsWriter(str(tmp_path), max_shard_bytes=900)
    base = torch.zeros(20, 10)
    writer.add("view", base[:10])  # a view of a larger tensor is stored on its own
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert files[-1] == "model.safetensors.index.json" and len(files) == 4  # 3 shards of <= 2 tensors
    index = json.load(open(tmp_path / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == 6 * 400 and len(index["weight_map"]) == 6
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    reader = HFReader(str(tmp_path))
    assert reader.names() == sorted(["view", *tensors]) and reader.shape("t3") == (10, 10)
    assert reader.dtype("t3") == torch.float32 and torch.equal(reader.get("t3"), tensors["t3"])
    with pytest.raises(ValueError, match="twice"):
        w = SafetensorsWriter(str(tmp_path / "x"), 100)
        w.add("a", torch.zeros(1))
        w.add("a", torch.zeros(1))


def test_reader_errors_name_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no weights"):
        HFReader(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-1.safetensors"):
        HFReader(str(tmp_path))


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("500MB") == 5 * 10**8
    assert parse_size(123) == 123 and parse_size("10") == 10
    with pytest.raises(ValueError, match="cannot parse"):
        parse_size("lots")
