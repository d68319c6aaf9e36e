"""HF -> aligner -> HF in one process (TP=1): logits/scores of our megatron model equal HF's own forward, the
round trip is bit-identical, the exported directory loads with AutoModel*, and bad inputs fail clearly and leave
nothing behind. Multi-rank layouts are in tests/distributed/test_convert_tp.py."""

import json
import os

import pytest
import torch
from convert_models import KINDS, N_TOKENS, TOKENS_BT, VOCAB, hf_outputs, hf_tensors, make_hf, tiny_tokenizer, write_bin
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
    convert_hf_to_dist(hf_dir, conv)
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
    assert sorted(os.listdir(conv)) == sorted(
        ["model", "model.yaml", "tokenizer", "hf_config.json", "conversion.json"]
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


def test_bfloat16_round_trip_and_sharded_files(tmp_path):
    hf_dir, conv, back = str(tmp_path / "hf"), str(tmp_path / "conv"), str(tmp_path / "back")
    make_hf("llama", hf_dir, dtype=torch.bfloat16, max_shard_size="40KB")
    assert os.path.exists(os.path.join(hf_dir, "model.safetensors.index.json"))
    convert_hf_to_dist(hf_dir, conv)  # dtype auto: as stored
    assert load_model_yaml(os.path.join(conv, "model.yaml")).params_dtype == "bfloat16"
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
