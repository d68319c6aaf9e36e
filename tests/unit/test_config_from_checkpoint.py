"""Jobs take the model from the checkpoint: `model.checkpoint=DIR` alone gives the actor's and the critic's model
sections (and the critic's reward_model) their shape and tokenizer from DIR/model.yaml; a shape key the user wrote
that disagrees is an error naming both values. Checkpoints are real conversions of tiny random HF models."""

import json
import os

import pytest
from convert_models import make_hf
from dist import free_port

from aligner.config import ConfigError
from aligner.config.actor import load_actor_config
from aligner.config.critic import load_critic_config
from aligner.config.loader import REPO_CONF_DIR

POSITIONS = 512  # the ppo_actor recipe generates 128 + 256 tokens


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{kind: converted dir}: a Qwen3 policy (with a generation_config.json listing two EOS ids) and a Llama 3.2-style
    reward model."""
    from aligner.checkpoint.convert import convert_hf_to_dist
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    for kind in ("qwen3", "llama3_reward"):
        hf_dir = str(root / f"hf_{kind}")
        make_hf(kind, hf_dir, overrides={"max_position_embeddings": POSITIONS})
        json.dump(
            {"eos_token_id": [2, 7], "bos_token_id": 1}, open(os.path.join(hf_dir, "generation_config.json"), "w")
        )
        out[kind] = convert_hf_to_dist(hf_dir, str(root / kind))
    return out


def _stored(directory):
    from aligner.checkpoint.convert import load_model_yaml

    return load_model_yaml(os.path.join(directory, "model.yaml"))


def test_the_actor_takes_shape_and_tokenizer_from_the_checkpoint(converted):
    policy = converted["qwen3"]
    cfg = load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={policy}"])
    stored = _stored(policy)
    # ppo_actor.yaml's `defaults: [model: llama_1b]` is a default: the checkpoint's shape replaces all of it
    for key in ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
        assert getattr(cfg.model, key) == getattr(stored, key), key
    assert (cfg.model.head_dim, cfg.model.qk_layernorm, cfg.model.vocab_size) == (24, True, 100)
    assert cfg.model.params_dtype == "float32"  # the checkpoint's (the preset says bfloat16)
    assert cfg.model.max_position_embeddings == POSITIONS
    assert cfg.model.tokenizer == os.path.join(policy, "tokenizer") and cfg.tokenizer_path == cfg.model.tokenizer
    assert cfg.model.attention_backend == "auto"  # run-time choices are never inherited
    # What the config says explicitly and agrees with the checkpoint, or may change, stays.
    cfg = load_actor_config(
        [
            "--config-name",
            "ppo_actor",
            f"model.checkpoint={policy}",
            "model.num_layers=2",
            "model.head_dim=24",
            "model.num_query_groups=2",
            "model.max_position_embeddings=400",  # shorter sequences: fine for RoPE
            "model.params_dtype=bfloat16",
        ]
    )
    assert (cfg.model.max_position_embeddings, cfg.model.params_dtype, cfg.model.hidden_size) == (400, "bfloat16", 64)


def test_the_tokenizer_brings_the_generation_config_stop_ids(converted):
    from aligner.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(
        load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={converted['qwen3']}"]).tokenizer_path
    )
    assert tokenizer.stop_ids == (2, 7)
    assert load_tokenizer("conf/demo/tokenizer.json").stop_ids == ()  # no generation_config.json beside it


@pytest.mark.parametrize(
    "override,key,words",
    [
        ("model.hidden_size=128", "model.hidden_size", "128 disagrees with the checkpoint's 64"),
        ("model.qk_layernorm=false", "model.qk_layernorm", "False disagrees with the checkpoint's True"),
        ("model.head_dim=16", "model.head_dim", "16 disagrees with the checkpoint's 24"),
        ("model.vocab_size=128", "model.vocab_size", "128 disagrees with the checkpoint's 100"),
        ("model.tie_embeddings=true", "model.tie_embeddings", "True disagrees with the checkpoint's False"),
        ("model.max_position_embeddings=1024", "model.max_position_embeddings", "may be lowered, never raised"),
        ("model=llama_1b", "model.num_layers", "16 disagrees with the checkpoint's 2"),  # a preset chosen by hand
    ],
)
def test_a_written_shape_key_that_disagrees_names_both_values(converted, override, key, words):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={converted['qwen3']}", override])
    assert words in str(err.value) and "model.yaml" in str(err.value)


def test_keys_in_the_config_file_itself_are_explicit(converted, tmp_path):
    """The demo recipe writes vocab_size: 48 in its own body: with a checkpoint of 100 tokens that is an error, while
    the shape its `defaults:` brings (the tiny preset) is simply replaced."""
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*48 disagrees with the checkpoint's 100"):
        load_actor_config(["--config-name", "ppo_actor_demo", f"model.checkpoint={converted['qwen3']}"])
    recipe = tmp_path / "mine.yaml"
    base = os.path.join(REPO_CONF_DIR, "ppo_actor_demo.yaml")
    recipe.write_text(f"defaults: [{base}]\nmodel:\n  checkpoint: {converted['qwen3']}\n")
    cfg = load_actor_config(["--config-path", str(tmp_path), "--config-name", "mine", "generation.max_prompt_length=8"])
    assert (cfg.model.vocab_size, cfg.model.qk_layernorm, cfg.model.tokenizer) == (
        100,
        True,
        os.path.join(converted["qwen3"], "tokenizer"),
    )
    assert cfg.model.make_vocab_size_divisible_by == 128  # the checkpoint's; the demo's 32 was only a default here


def test_the_critic_takes_both_models_from_their_checkpoints(converted):
    cfg = load_critic_config(
        [
            "--config-name",
            "ppo_critic",
            f"model.checkpoint={converted['qwen3']}",  # a value model initialised from the policy
            f"reward_model.checkpoint={converted['llama3_reward']}",
        ]
    )
    assert (cfg.model.qk_layernorm, cfg.model.head_dim, cfg.model.num_layers) == (True, 24, 2)
    rm = cfg.reward_model
    assert (rm.rope_scaling, rm.rope_scaling_factor, rm.tie_embeddings, rm.num_layers) == ("llama3", 5.0, True, 2)
    assert rm.tokenizer == os.path.join(converted["llama3_reward"], "tokenizer")
    with pytest.raises(ConfigError, match=r"reward_model\.rope_scaling_factor.*8\.0 disagrees .* 5\.0"):
        load_critic_config(
            [
                "--config-name",
                "ppo_critic",
                f"model.checkpoint={converted['qwen3']}",
                f"reward_model.checkpoint={converted['llama3_reward']}",
                "reward_model.rope_scaling_factor=8.0",
            ]
        )


def test_a_relative_checkpoint_and_one_without_model_yaml(converted, tmp_path, monkeypatch):
    monkeypatch.chdir(os.path.dirname(converted["qwen3"]))
    cfg = load_actor_config(["--config-name", "ppo_actor", "model.checkpoint=qwen3"])
    assert cfg.model.checkpoint == converted["qwen3"] and cfg.model.qk_layernorm
    bare = tmp_path / "bare"  # e.g. a step saved without model.yaml: the section stays as written
    bare.mkdir()
    cfg = load_actor_config(
        ["--config-name", "ppo_actor", f"model.checkpoint={bare}", "model.tokenizer=conf/demo/tokenizer.json"]
    )
    assert cfg.model.num_layers == 16  # the llama_1b preset
    with pytest.raises(ConfigError, match=r"model\.checkpoint.*not found"):
        load_actor_config(["--config-name", "ppo_actor", "model.checkpoint=no/such/dir"])


def test_the_filled_config_builds_the_model_that_loads_strictly(converted):
    """What the jobs build from `model.checkpoint` alone: the policy (and its engine), and the critic from the policy's
    backbone, load without a mismatch."""
    from aligner.checkpoint.dist_ckpt import load_backbone_weights, load_model_weights
    from aligner.models.gpt import build_gpt

    actor = load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={converted['qwen3']}"])
    load_model_weights(actor.model.checkpoint, [build_gpt(actor.model)])
    critic = load_critic_config(
        [
            "--config-name",
            "ppo_critic",
            f"model.checkpoint={converted['qwen3']}",
            f"reward_model.checkpoint={converted['llama3_reward']}",
        ]
    )
    load_backbone_weights(critic.model.checkpoint, [build_gpt(critic.model, head="scalar")])
    load_model_weights(critic.reward_model.checkpoint, [build_gpt(critic.reward_model, head="scalar")])


def test_a_job_checkpoint_describes_itself_too(converted, tmp_path):
    """A step directory the actor saved (dist_ckpt.save with model_cfg) is a checkpoint like a converted one: its
    model.yaml gives the shape, the tokenizer it names is found, and the weights load strictly."""
    from aligner.checkpoint import dist_ckpt
    from aligner.models.gpt import build_gpt

    actor = load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={converted['qwen3']}"])
    model = build_gpt(actor.model)
    dist_ckpt.load_model_weights(actor.model.checkpoint, [model])
    step = dist_ckpt.save(str(tmp_path / "run"), 3, [model], model_cfg=actor.model)
    again = load_actor_config(["--config-name", "ppo_actor", f"model.checkpoint={step}"])
    assert again.model.checkpoint == step and again.model.tokenizer == actor.model.tokenizer
    assert (again.model.head_dim, again.model.qk_layernorm, again.model.num_layers) == (24, True, 2)
    dist_ckpt.load_model_weights(step, [build_gpt(again.model)])
