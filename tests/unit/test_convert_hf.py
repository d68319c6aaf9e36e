"""HF -> aligner -> HF in one process (TP=1): logits/scores of our megatron model equal HF's own forward, the
round trip is bit-identical, the exported directory loads with AutoModel*, and bad inputs fail clearly and leave
nothing behind. Multi-rank layouts are in tests/distributed/test_convert_tp.py."""

import json
import os

import pytest
import torch
from convert_models import (
    CONVERT_CAP,
    KINDS,
    LONGROPE_ATTENTION,
    N_TOKENS,
    TOKENS_BT,
    VOCAB,
    hf_outputs,
    hf_tensors,
    make_hf,
    tiny_tokenizer,
    write_bin,
)
from dist import free_port

from aligner.checkpoint import convert
from aligner.checkpoint.convert import convert_dist_to_hf, convert_hf_to_dist, load_model_yaml
from aligner.checkpoint.hf import CheckpointMismatchError, UnsupportedModelError


@pytest.fixture(scope="module", autouse=True)
def _megatron():
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())


def ours(directory: str) -> torch.Tensor:
    """Our megatron model loaded from a converted directory: logits [B,T,VOCAB] (padding cut) or values [B,T,1]."""
    from aligner.checkpoint.dist_ckpt import load_model_weights
    from aligner.models.gpt import build_gpt, forward

    cfg = load_model_yaml(os.path.join(directory, "model.yaml"))
    head = "scalar" if json.load(open(os.path.join(directory, "conversion.json")))["model_type"] == "reward" else "lm"
    model = build_gpt(cfg, head=head)
    load_model_weights(directory, [model])
    model.eval()
    with torch.no_grad():
        out = forward(model, TOKENS_BT)
    return out if head == "scalar" else out[..., :VOCAB]


@pytest.mark.parametrize("kind", [*KINDS, "gpt2_reward"])
def test_hf_to_ours_to_hf(kind, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    hf_dir, conv, back = str(tmp_path / "hf"), str(tmp_path / "conv"), str(tmp_path / "back")
    hf = make_hf(kind, hf_dir)
    convert_hf_to_dist(hf_dir, conv, max_position_embeddings=CONVERT_CAP.get(kind))
    reward = kind.endswith("reward")
    info = json.load(open(os.path.join(conv, "conversion.json")))
    assert info["model_type"] == ("reward" if reward else "policy")
    # transformers may add special tokens for the model type (Qwen2: <|endoftext|>); the tokenizer we ship loads
    # as the same tokenizer.
    n_tokens = len(AutoTokenizer.from_pretrained(hf_dir))
    assert info["tokenizer_size"] == n_tokens == len(AutoTokenizer.from_pretrained(os.path.join(conv, "tokenizer")))
    assert n_tokens in (N_TOKENS, N_TOKENS + 1)
    cfg = load_model_yaml(os.path.join(conv, "model.yaml"))
    assert cfg.checkpoint == conv and cfg.tokenizer == os.path.join(conv, "tokenizer") and cfg.vocab_size == VOCAB
    if kind in CONVERT_CAP:  # LongRoPE: the attention factor HF derives from 256 of 64 positions, by hand
        assert cfg.rope_scaling_attention_factor == pytest.approx(LONGROPE_ATTENTION, rel=1e-12)
    assert sorted(os.listdir(conv)) == sorted(
        ["model", "model.yaml", "tokenizer", "hf_config.json", "conversion.json", "manifest.json"]
        + (["generation_config.json"] if not reward else [])
    )
    expected = hf_outputs(hf)
    torch.testing.assert_close(ours(conv), expected, rtol=0, atol=1e-4)

    convert_dist_to_hf(conv, back)
    original, exported = hf_tensors(hf_dir), hf_tensors(back)
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype and torch.equal(exported[name], t), name
    assert json.load(open(os.path.join(back, "config.json"))) == {
        **json.load(open(os.path.join(hf_dir, "config.json")))
    }
    auto = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    reloaded = auto.from_pretrained(back, attn_implementation="eager").eval()
    assert torch.equal(hf_outputs(reloaded), expected)
    if reward:  # HF's pooled score (last non-pad token) is ours at the last position
        with torch.no_grad():
            torch.testing.assert_close(reloaded(TOKENS_BT).logits, expected[:, -1], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bfloat16_round_trip_and_sharded_files(kind, tmp_path):
    hf_dir, conv, back = str(tmp_path / "hf"), str(tmp_path / "conv"), str(tmp_path / "back")
    make_hf(kind, hf_dir, dtype=torch.bfloat16, max_shard_size="40KB")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    convert_hf_to_dist(hf_dir, conv)  # dtype auto: as stored
    assert load_model_yaml(os.path.join(conv, "model.yaml")).params_dtype == "bfloat16"
    # the model runs in bf16 (GPT-2's learned positions included: megatron builds them in float32) and computes
    # the function of these weights as closely as HF's own bf16 forward: both against float32 maths of the same
    # bf16 weights, HF's models loaded from the directory (from_pretrained keeps RoPE's frequencies in float32)
    from transformers import AutoModelForCausalLM

    logits = ours(conv)
    assert logits.dtype == torch.bfloat16
    with torch.no_grad():
        exact, theirs = (
            hf_outputs(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()).float()
            for dtype in (torch.float32, torch.bfloat16)
        )
    ours_off, theirs_off = ((x.float() - exact).abs().mean() for x in (logits, theirs))
    assert theirs_off > 0 and ours_off <= 1.5 * theirs_off, (ours_off, theirs_off)
    convert_dist_to_hf(conv, back, max_shard_size="40KB")
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    original, exported = hf_tensors(hf_dir), hf_tensors(back)
    assert sorted(exported) == sorted(original)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], t) for n, t in original.items())


def test_sliding_window_capped_to_the_window(tmp_path):
    """Mistral with a 16-token window and 64 positions: refused as is; capped at 16 positions it is exact (12-token
    inputs see no window), and the export restores the original config."""
    hf_dir, conv, back = str(tmp_path / "hf"), str(tmp_path / "conv"), str(tmp_path / "back")
    hf = make_hf("mistral", hf_dir, overrides={"sliding_window": 16})
    with pytest.raises(UnsupportedModelError, match="--max-position-embeddings 16"):
        convert_hf_to_dist(hf_dir, conv)
    convert_hf_to_dist(hf_dir, conv, max_position_embeddings=16)
    assert load_model_yaml(os.path.join(conv, "model.yaml")).max_position_embeddings == 16
    torch.testing.assert_close(ours(conv), hf_outputs(hf), rtol=0, atol=1e-4)
    convert_dist_to_hf(conv, back)
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(hf_dir, "config.json")))


def test_pytorch_bin_shards_and_bare_gpt2_names(tmp_path):
    """Old-style files: sharded pytorch_model-*.bin, GPT-2 names without 'transformer.', causal-mask buffers."""
    hf = make_hf("gpt2")
    src = str(tmp_path / "bin")
    write_bin(hf, src, shards=2, prefix_strip="transformer.")
    extra = os.path.join(src, "pytorch_model-00001-of-00002.bin")
    state = torch.load(extra)
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))  # a buffer old GPT-2 files carry
    torch.save(state, extra)
    index = os.path.join(src, "pytorch_model.bin.index.json")
    meta = json.load(open(index))
    meta["weight_map"]["h.0.attn.bias"] = "pytorch_model-00001-of-00002.bin"
    json.dump(meta, open(index, "w"))
    convert_hf_to_dist(src, str(tmp_path / "conv"))
    torch.testing.assert_close(ours(str(tmp_path / "conv")), hf_outputs(hf), rtol=0, atol=1e-4)


def test_clear_errors_and_nothing_left_behind(tmp_path):
    hf_dir = str(tmp_path / "hf")
    make_hf("llama", hf_dir)
    out = str(tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        convert_hf_to_dist(str(tmp_path), out)
    with pytest.raises(UnsupportedModelError, match="--model-type reward"):
        convert_hf_to_dist(hf_dir, out, model_type="reward")
    with pytest.raises(ValueError, match="--tp 3"):
        convert_hf_to_dist(hf_dir, out, tp=3)
    big_tok = str(tmp_path / "tok")
    tiny_tokenizer(VOCAB + 5).save_pretrained(big_tok)
    with pytest.raises(CheckpointMismatchError, match="105 tokens but the embedding has 100 rows"):
        convert_hf_to_dist(hf_dir, out, tokenizer=big_tok)
    os.remove(os.path.join(hf_dir, "tokenizer.json"))
    os.remove(os.path.join(hf_dir, "tokenizer_config.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        convert_hf_to_dist(hf_dir, out)
    tiny_tokenizer().save_pretrained(hf_dir)

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump(dict(cfg, intermediate_size=64), open(os.path.join(hf_dir, "config.json"), "w"))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"gate_proj.weight has shape \(96, 64\) but config.json "
        r"implies \(64, 64\)",
    ):
        convert_hf_to_dist(hf_dir, out)
    json.dump(dict(cfg, num_hidden_layers=3), open(os.path.join(hf_dir, "config.json"), "w"))
    with pytest.raises(CheckpointMismatchError, match="lacks 9 tensor"):
        convert_hf_to_dist(hf_dir, out)
    json.dump(dict(cfg, num_hidden_layers=1), open(os.path.join(hf_dir, "config.json"), "w"))
    with pytest.raises(UnsupportedModelError, match="no place"):
        convert_hf_to_dist(hf_dir, out)
    json.dump(cfg, open(os.path.join(hf_dir, "config.json"), "w"))
    assert sorted(os.listdir(tmp_path)) == ["hf", "tok"]

    def broken(*args, **kwargs):
        raise OSError("disk full")

    # A failure after the weights were written (while writing the tokenizer) still leaves no directory behind.
    original = convert.copy_tokenizer
    convert.copy_tokenizer = broken
    try:
        with pytest.raises(OSError, match="disk full"):
            convert_hf_to_dist(hf_dir, out)
    finally:
        convert.copy_tokenizer = original
    assert sorted(os.listdir(tmp_path)) == ["hf", "tok"]
    convert_hf_to_dist(hf_dir, out)
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert_hf_to_dist(hf_dir, out)
    convert_hf_to_dist(hf_dir, out, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["hf", "out", "tok"]


def test_reverse_errors(tmp_path):
    hf_dir, conv = str(tmp_path / "hf"), str(tmp_path / "conv")
    make_hf("llama_reward", hf_dir)
    convert_hf_to_dist(hf_dir, conv)
    with pytest.raises(FileNotFoundError, match="not an aligner checkpoint"):
        convert_dist_to_hf(hf_dir, str(tmp_path / "x"))
    with pytest.raises(CheckpointMismatchError, match="holds a reward model"):
        convert_dist_to_hf(conv, str(tmp_path / "x"), model_type="policy")
    wrong = str(tmp_path / "wrong.yaml")
    open(wrong, "w").write(open(os.path.join(conv, "model.yaml")).read().replace("num_layers: 2", "num_layers: 4"))
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint stores shape \(2, 64\) but .*wrong.yaml implies"):
        convert_dist_to_hf(conv, str(tmp_path / "x"), model_config=wrong)
    with_source = str(tmp_path / "with_source")  # a model.yaml beside the source's hf_config.json
    os.makedirs(with_source)
    open(os.path.join(with_source, "model.yaml"), "w").write(open(wrong).read())
    open(os.path.join(with_source, "hf_config.json"), "w").write(open(os.path.join(conv, "hf_config.json")).read())
    with pytest.raises(CheckpointMismatchError, match="num_layers=2 but model.yaml has 4"):
        convert_dist_to_hf(conv, str(tmp_path / "x"), model_config=with_source)
    with pytest.raises(FileNotFoundError, match="no model.yaml"):
        convert_dist_to_hf(os.path.join(conv, "model"), str(tmp_path / "x"))

    # A scalar head whose bias moved off 0 cannot be expressed by HF's bias-free score layer.
    from aligner.checkpoint.dist_ckpt import load_model_weights
    from aligner.models.gpt import build_gpt

    cfg = load_model_yaml(os.path.join(conv, "model.yaml"))
    model = build_gpt(cfg, head="scalar")
    load_model_weights(conv, [model])
    with torch.no_grad():
        model.output_layer.bias.fill_(0.5)
    from megatron.core import dist_checkpointing

    trained = str(tmp_path / "trained")
    os.makedirs(os.path.join(trained, "model"))
    dist_checkpointing.save(model.sharded_state_dict(), os.path.join(trained, "model"))
    with pytest.raises(UnsupportedModelError, match="bias 0.5"):
        convert_dist_to_hf(trained, str(tmp_path / "x"), model_config=conv)
    out = convert_dist_to_hf(trained, str(tmp_path / "x"), model_config=conv, drop_score_bias=True)
    assert "config.json" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == sorted(["hf", "conv", "wrong.yaml", "with_source", "trained", "x"])


def test_critic_backbone_from_a_converted_policy(tmp_path):
    """A scalar-head model takes every weight of a converted policy but the LM head (which it cannot hold)."""
    from aligner.checkpoint.dist_ckpt import load_backbone_weights
    from aligner.models.gpt import build_gpt

    hf_dir, conv = str(tmp_path / "hf"), str(tmp_path / "conv")
    make_hf("llama", hf_dir)
    convert_hf_to_dist(hf_dir, conv)
    cfg = load_model_yaml(os.path.join(conv, "model.yaml"))
    policy = build_gpt(cfg, head="lm")
    from aligner.checkpoint.dist_ckpt import load_model_weights

    load_model_weights(conv, [policy])
    critic = build_gpt(cfg, head="scalar")
    head_before = {k: v.clone() for k, v in critic.output_layer.state_dict().items()}
    load_backbone_weights(conv, [critic])
    theirs = critic.state_dict()
    for name, t in policy.state_dict().items():
        if name.endswith("_extra_state") or name.startswith("output_layer."):
            continue
        assert torch.equal(theirs[name], t), name
    for name, t in head_before.items():
        assert torch.equal(critic.output_layer.state_dict()[name], t)


def test_new_families_model_yaml(tmp_path):
    """What the converter reads off Llama 3.2-style and Qwen3 configs lands in model.yaml."""
    from convert_models import LLAMA3_ROPE, QWEN3_HEAD_DIM

    for kind in ("llama3", "qwen3"):
        make_hf(kind, str(tmp_path / kind))
        convert_hf_to_dist(str(tmp_path / kind), str(tmp_path / f"conv_{kind}"))
    llama3 = load_model_yaml(str(tmp_path / "conv_llama3" / "model.yaml"))
    assert llama3.tie_embeddings and llama3.rope_scaling == "llama3" and llama3.head_dim is None
    assert (
        llama3.rope_scaling_factor,
        llama3.rope_scaling_low_freq_factor,
        llama3.rope_scaling_high_freq_factor,
        llama3.rope_scaling_original_max_position_embeddings,
    ) == tuple(
        LLAMA3_ROPE[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    )
    qwen3 = load_model_yaml(str(tmp_path / "conv_qwen3" / "model.yaml"))
    assert (qwen3.head_dim, qwen3.qk_layernorm, qwen3.rotary_base, qwen3.rope_scaling) == (
        QWEN3_HEAD_DIM,
        True,
        1e6,
        None,
    )


def test_llama3_rope_frequencies_are_hf_s_bit_for_bit(tmp_path):
    """megatron's own llama3 scaling hard-codes low/high_freq_factor and original_max_position_embeddings (1, 4,
    8192); ours reads them from the config and equals HF's frequencies exactly."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from aligner.models.gpt import build_gpt

    hf = make_hf("llama3", str(tmp_path / "hf"))
    convert_hf_to_dist(str(tmp_path / "hf"), str(tmp_path / "conv"))
    cfg = load_model_yaml(str(tmp_path / "conv" / "model.yaml"))
    ours_ = build_gpt(cfg).rotary_pos_emb.inv_freq
    theirs = hf.model.rotary_emb.inv_freq
    assert ours_.dtype == theirs.dtype == torch.float32 and torch.equal(ours_, theirs)
    megatrons = RotaryEmbedding(
        16, 1.0, rotary_base=10000, rope_scaling=True, rope_scaling_factor=5.0, use_cpu_initialization=True
    ).inv_freq
    assert not torch.allclose(megatrons, theirs, rtol=1e-3), "the test needs numbers megatron's constants get wrong"
    # Plain RoPE through the same function, with a base megatron would truncate to an int
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from aligner.config.schema import ModelConfig
    from aligner.models.rope import rope_inv_freq

    theta = 12345.6
    hf_plain = LlamaRotaryEmbedding(
        LlamaConfig(
            hidden_size=64, num_attention_heads=4, rope_parameters={"rope_type": "default", "rope_theta": theta}
        )
    ).inv_freq
    assert torch.equal(rope_inv_freq(ModelConfig(hidden_size=64, num_attention_heads=4, rotary_base=theta)), hf_plain)


def test_loading_is_strict_and_names_the_tensor(tmp_path):
    """A config that does not describe the checkpoint fails naming the tensor and the key to check, instead of
    leaving tensors behind (Qwen2's q/k/v biases, Qwen3's q/k norms) or loading part of a layer stack."""
    import dataclasses

    from aligner.checkpoint import dist_ckpt
    from aligner.checkpoint.dist_ckpt import CheckpointMismatchError, load_backbone_weights, load_model_weights
    from aligner.models.gpt import build_gpt

    for kind in ("qwen2", "qwen3", "llama3"):
        make_hf(kind, str(tmp_path / kind))
        convert_hf_to_dist(str(tmp_path / kind), str(tmp_path / f"conv_{kind}"))
    qwen2 = load_model_yaml(str(tmp_path / "conv_qwen2" / "model.yaml"))
    qwen3 = load_model_yaml(str(tmp_path / "conv_qwen3" / "model.yaml"))
    llama3 = load_model_yaml(str(tmp_path / "conv_llama3" / "model.yaml"))
    cases = [
        (
            "conv_qwen2",
            dataclasses.replace(qwen2, add_qkv_bias=False),
            "lm",
            r"has decoder\.layers\.self_attention"
            r"\.linear_qkv\.bias, which the config has no place for.*check model\.add_qkv_bias",
        ),
        (
            "conv_qwen3",
            dataclasses.replace(qwen3, qk_layernorm=False),
            "lm",
            r"q_layernorm\.weight.*model\.qk_layernorm",
        ),
        (
            "conv_qwen3",
            dataclasses.replace(qwen3, head_dim=None),
            "lm",
            r"linear_proj\.weight: the checkpoint stores "
            r"shape \(2, 64, 96\) but the config implies \(2, 64, 64\)",
        ),
        (
            "conv_qwen2",
            dataclasses.replace(qwen2, num_layers=3),
            "lm",
            r"stores shape \(2, 64\) but the config "
            r"implies \(3, 64\)",
        ),
        (
            "conv_llama3",
            dataclasses.replace(llama3, tie_embeddings=False),
            "lm",
            r"output_layer\.weight is missing"
            r".*model\.tie_embeddings",
        ),
        ("conv_llama3", llama3, "scalar", r"output_layer\.weight is missing"),  # a critic needs the backbone load
        (  # every problem at once, each with its key
            "conv_qwen2",
            dataclasses.replace(qwen2, tie_embeddings=False, add_qkv_bias=False),
            "lm",
            r"output_layer\.weight is missing.*linear_qkv\.bias.*check model\.add_qkv_bias; model\.tie_embeddings",
        ),
    ]
    for conv, cfg, head, match in cases:
        model = build_gpt(cfg, head=head)
        before = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        with pytest.raises(CheckpointMismatchError, match=match):
            load_model_weights(str(tmp_path / conv), [model])
        after = model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), "checked before any tensor is read"
    # The one documented exception: a critic takes a (tied) policy's backbone, its head stays as built.
    critic = build_gpt(llama3, head="scalar")
    load_backbone_weights(str(tmp_path / "conv_llama3"), [critic])
    with pytest.raises(CheckpointMismatchError, match="q_layernorm"):  # the backbone itself is still strict
        load_backbone_weights(
            str(tmp_path / "conv_qwen3"), [build_gpt(dataclasses.replace(qwen3, qk_layernorm=False), head="scalar")]
        )
    # A job checkpoint (dist_ckpt.save / load) is held to the same rule.
    policy = build_gpt(qwen2)
    load_model_weights(str(tmp_path / "conv_qwen2"), [policy])
    dist_ckpt.save(str(tmp_path / "run"), 1, [policy], state={"consumed_samples": 0})
    with pytest.raises(CheckpointMismatchError, match="linear_qkv.bias"):
        dist_ckpt.load(
            str(tmp_path / "run" / "step_000001"), [build_gpt(dataclasses.replace(qwen2, add_qkv_bias=False))]
        )
    again = build_gpt(qwen2)
    dist_ckpt.load(str(tmp_path / "run" / "step_000001"), [again])
    assert all(torch.equal(again.state_dict()[k], v) for k, v in policy.state_dict().items() if "_extra" not in k)
