"""Config loading: YAML onto the typed schema, overrides, `defaults` recipes, and each validation error."""

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from aligner.config import (
    ConfigError,
    ModelConfig,
    ParallelConfig,
    load_config,
    parse_cli,
    validate_batch,
    validate_layout,
    validate_model,
)
from aligner.config.loader import omegaconf_too_old


@dataclass
class TrainSection:
    global_batch_size: int = 8
    micro_batch_size: int = 2


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainSection = field(default_factory=TrainSection)
    world_size: int = 4

    def validate(self):
        validate_model(self.model)
        dp = validate_layout(self.model, self.parallel, self.world_size)
        validate_batch(
            self.train.global_batch_size,
            self.train.micro_batch_size,
            dp,
            "train.global_batch_size",
            "train.micro_batch_size",
        )


@pytest.fixture
def conf_dir(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  num_layers: 4\n  hidden_size: 128\n  num_attention_heads: 8\n")
    (tmp_path / "recipe.yaml").write_text(
        "defaults: [base]\nmodel:\n  hidden_size: 256\ntrain:\n  micro_batch_size: 1\n"
    )
    return tmp_path


def test_yaml_defaults_and_overrides(conf_dir):
    cfg = load_config(
        JobConfig, "recipe", ["model.num_layers=8", "parallel.tensor_model_parallel_size=2"], str(conf_dir)
    )
    assert isinstance(cfg, JobConfig) and isinstance(cfg.model, ModelConfig)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (8, 256, 8)
    assert cfg.train.micro_batch_size == 1 and cfg.parallel.tensor_model_parallel_size == 2


def test_cli_parsing():
    assert parse_cli(["--config-name", "x", "a.b=1"], "d") == (None, "x", ["a.b=1"])
    assert parse_cli(["--config-name=y", "--config-path=/c"], "d") == ("/c", "y", [])
    assert parse_cli([], "d") == (None, "d", [])
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_cli(["model.num_layers"], "d")


def test_unknown_key_names_it(conf_dir):
    (conf_dir / "typo.yaml").write_text("model:\n  num_layer: 4\n")
    with pytest.raises(ConfigError, match="model.num_layer"):
        load_config(JobConfig, "typo", [], str(conf_dir))
    with pytest.raises(ConfigError, match="model.hiden_size"):
        load_config(JobConfig, "base", ["model.hiden_size=3"], str(conf_dir))


def test_wrong_type_names_it(conf_dir):
    with pytest.raises(ConfigError, match="model.num_layers"):
        load_config(JobConfig, "base", ["model.num_layers=many"], str(conf_dir))


def test_missing_config_lists_available(conf_dir):
    with pytest.raises(ConfigError, match="available: base, recipe"):
        load_config(JobConfig, "nope", [], str(conf_dir))


# a valid LongRoPE for the base config's head width (16: eight frequencies) and its positions
LONGROPE = [
    "model.rope_scaling=longrope",
    "model.rope_scaling_short_factor=[1,2,3,4,5,6,7,8]",
    "model.rope_scaling_long_factor=[2,4,6,8,10,12,14,16]",
    "model.rope_scaling_original_max_position_embeddings=2048",
]


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (
            ["world_size=3", "parallel.tensor_model_parallel_size=2"],
            "parallel.tensor_model_parallel_size",
            "world size 3 is not divisible",
        ),
        (
            ["parallel.tensor_model_parallel_size=3", "world_size=3"],
            "parallel.tensor_model_parallel_size",
            "num_attention_heads=8 is not divisible by TP=3",
        ),
        (
            ["parallel.pipeline_model_parallel_size=3", "world_size=3"],
            "parallel.pipeline_model_parallel_size",
            "num_layers=4 is not divisible by PP=3",
        ),
        (["train.global_batch_size=6"], "train.global_batch_size", "not divisible by train.micro_batch_size=2 x"),
        (["model.num_query_groups=3"], "model.num_query_groups", "not divisible by num_query_groups=3"),
        (["model.arch=bert"], "model.arch", "must be one of gpt2, llama"),
        (["model.params_dtype=fp8"], "model.params_dtype", "must be one of"),
        (
            ["model.hidden_size=100"],
            "model.hidden_size",
            "not divisible by num_attention_heads=8 (or set model.head_dim)",
        ),
        (["model.head_dim=15"], "model.head_dim", "the head width 15 must be even"),
        (["model.head_dim=0"], "model.head_dim", "must be positive"),
        (["model.rope_scaling=yarn"], "model.rope_scaling", "must be one of llama3"),
        (["model.rope_scaling=llama3", "model.rope_scaling_factor=0.5"], "model.rope_scaling_factor", "must be >= 1"),
        (
            ["model.rope_scaling=llama3", "model.rope_scaling_low_freq_factor=4"],
            "model.rope_scaling_low_freq_factor",
            "below rope_scaling_high_freq_factor=4.0",
        ),
        (["model.arch=gpt2", "model.rope_scaling=llama3"], "model.rope_scaling", "has no RoPE to scale"),
        (["model.rope_scaling=longrope"], "model.rope_scaling_short_factor", "longrope needs 8 positive numbers"),
        (
            [*LONGROPE, "model.rope_scaling_long_factor=[1,2,3]"],
            "model.rope_scaling_long_factor",
            "got [1.0, 2.0, 3.0]",
        ),
        (
            [*LONGROPE, "model.rope_scaling_original_max_position_embeddings=64"],
            "model.max_position_embeddings",
            "within its pre-training context: at most rope_scaling_original_max_position_embeddings=64, got 2048",
        ),
        ([*LONGROPE, "model.rope_scaling_attention_factor=0"], "model.rope_scaling_attention_factor", "positive"),
        (["model.rotary_percent=0.7"], "model.rotary_percent", "an even number of the head's 16 channels, got 0.7"),
        (["model.rotary_percent=0"], "model.rotary_percent", "must be in (0, 1]"),
        (["model.nope_layers=[4]"], "model.nope_layers", "distinct layers in [0, num_layers=4) (0-based"),
        (["model.nope_layers=[1,1]"], "model.nope_layers", "got [1, 1]"),
        (["model.arch=gpt2", "model.nope_layers=[0]"], "model.nope_layers", "has no RoPE to leave out"),
        ([*LONGROPE, "model.nope_layers=[3]"], "model.nope_layers", "not supported with rope_scaling=longrope"),
        (  # LongRoPE over 3/4 of the head (6 frequencies) with its attention factor: only SDPA scales the rest
            [
                "model.rope_scaling=longrope",
                "model.rotary_percent=0.75",
                "model.rope_scaling_short_factor=[1,2,3,4,5,6]",
                "model.rope_scaling_long_factor=[2,4,6,8,10,12]",
                "model.rope_scaling_original_max_position_embeddings=2048",
                "model.rope_scaling_attention_factor=1.2",
                "model.attention_backend=te",
            ],
            "model.attention_backend",
            "'te' cannot scale the channels RoPE passes",
        ),
    ],
)
def test_validation_errors_name_the_key(conf_dir, overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, "base", overrides, str(conf_dir))
    assert info.value.key == key
    assert words in str(info.value)


def test_on_and_off_are_the_words_not_booleans(conf_dir):
    """YAML 1.1 reads on/off/yes/no as booleans, which the choices auto|on|off refused ('got False'); in files and
    overrides they are the words, and a bool field still takes them."""
    (conf_dir / "words.yaml").write_text(
        "defaults: [base]\nmodel:\n  rope_fusion: off  # the choice\n  tie_embeddings: yes\n  tokenizer: 'on'\n"
    )
    cfg = load_config(JobConfig, "words", [], str(conf_dir))
    assert (cfg.model.rope_fusion, cfg.model.tie_embeddings, cfg.model.tokenizer) == ("off", True, "on")
    overrides = ["model.logprob_fusion=on", "model.rope_fusion=OFF", "model.tie_embeddings=off", "model.tokenizer=no"]
    with pytest.raises(ConfigError, match="must be one of auto, on, off; got 'OFF'"):
        load_config(JobConfig, "words", overrides, str(conf_dir))
    cfg = load_config(JobConfig, "words", [o.replace("OFF", "off") for o in overrides], str(conf_dir))
    assert (cfg.model.logprob_fusion, cfg.model.rope_fusion, cfg.model.tie_embeddings) == ("on", "off", False)
    assert cfg.model.tokenizer == "no"


def test_an_explicit_head_width_frees_hidden_size_from_the_head_count(conf_dir):
    cfg = load_config(JobConfig, "base", ["model.hidden_size=100", "model.head_dim=24"], str(conf_dir))
    assert (cfg.model.kv_channels, ModelConfig(hidden_size=64, num_attention_heads=4).kv_channels) == (24, 16)


def test_gqa_groups_must_split_over_tp():
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1)
    with pytest.raises(ConfigError, match="num_query_groups=1 is not divisible by TP=2"):
        validate_layout(model, ParallelConfig(tensor_model_parallel_size=2), 2)
    assert validate_layout(model, ParallelConfig(), 4) == 4


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["ppo.advantage_estimator=gae"], "reward.source", "gae trains the critic job's value model"),
        (["ppo.n_samples_per_prompt=1"], "ppo.n_samples_per_prompt", "grpo compares the samples of a prompt"),
        (
            ["ppo.advantage_estimator=reinforce_pp", "ppo.dynamic_sampling.enabled=true"],
            "ppo.dynamic_sampling.enabled",
            "grpo or rloo",
        ),
        (["ppo.overlong.buffer=300"], "ppo.overlong.buffer", "(the response length limit; 0 = off), got 300"),
        (["reward.fn=null"], "reward.fn", "reward.source=function needs reward.fn"),
        (["reward.fn=conf/demo/nowhere.py"], "reward.fn", "not found"),
        (["reward.fn=conf/demo/plus_one.jsonl"], "reward.fn", "must name a Python file"),
        (["reward.timeout=0"], "reward.timeout", "must be > 0"),
        (["generation.max_batch_size=4"], "generation.max_batch_size", "a prompt's samples go in one call"),
        (["ppo.critic_warmup_steps=2"], "ppo.critic_warmup_steps", "no critic to warm up"),
        (["ppo.kl.placement=both"], "ppo.kl.placement", "must be one of"),
        (["ppo.micro_batch_tokens=0"], "ppo.micro_batch_tokens", "must be >= 1 (or null: micro-batches by rows)"),
        (
            ["ppo.micro_batch_tokens=4096", "parallel.pipeline_model_parallel_size=2"],
            "ppo.micro_batch_tokens",
            "needs pipeline_model_parallel_size=1",
        ),
    ],
)
def test_rl_recipe_errors_name_the_key(overrides, key, words):
    from aligner.config.actor import load_actor_config

    with pytest.raises(ConfigError) as info:
        load_actor_config(["--config-name", "grpo_demo", *overrides])
    assert info.value.key == key, info.value
    assert words in str(info.value)


def test_groups_must_split_over_dp_in_whole_mini_batches():
    from aligner.config.actor import load_actor_config

    overrides = ["ppo.rollout_batch_size=6", "ppo.n_samples_per_prompt=8", "ppo.micro_batch_size=8"]
    cfg = load_actor_config(["--config-name", "grpo_demo", *overrides])
    assert cfg.samples_per_step == 48 and cfg.validate_world(2) == 2  # 3 prompts x 8 samples per rank
    with pytest.raises(ConfigError, match="ppo.rollout_batch_size"):
        cfg.validate_world(4)  # 6 prompts over 4 ranks
    cfg.ppo.micro_batch_size = 16
    with pytest.raises(ConfigError, match="a mini-batch of 24 rollouts per data-parallel rank"):
        cfg.validate_world(2)
    cfg.ppo.micro_batch_tokens = 4096  # micro-batches by tokens: the row count need not divide anything
    assert cfg.validate_world(2) == 2


def test_reward_function_spec_keeps_its_name():
    from aligner.config.actor import load_actor_config

    cfg = load_actor_config(["--config-name", "grpo_demo"])
    path, _, name = cfg.reward.fn.rpartition(":")
    assert os.path.isabs(path) and path.endswith("aligner/rewards/math_answer.py") and name == "flexible_reward_fn"


def test_critic_reward_only_mode():
    from aligner.config.critic import load_critic_config

    cfg = load_critic_config(["--config-name", "reward_critic_demo"])
    assert cfg.reward_only and cfg.models == [] and cfg.max_seq_len == 128 and cfg.validate_world(3) == 3
    with pytest.raises(ConfigError, match="server.max_seq_len"):
        load_critic_config(["--config-name", "reward_critic_demo", "server.max_seq_len=null"])
    with_rm = load_critic_config(
        ["--config-name", "reward_critic", "model@reward_model=tiny", "reward_model.vocab_size=48"]
    )
    assert with_rm.reward_only and [k for k, _ in with_rm.models] == ["reward_model"] and with_rm.vocab_size == 48


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.micro_batch_tokens=0"], "must be >= 1 (or null: by rows), got 0"),
        (["infer.micro_batch_tokens=512", "parallel.pipeline_model_parallel_size=2"], "needs pipeline_model"),
    ],
)
def test_critic_micro_batch_tokens_rules(overrides, words):
    from aligner.config.critic import load_critic_config

    assert load_critic_config(["--config-name", "ppo_critic_demo", "train.micro_batch_tokens=512"])
    with pytest.raises(ConfigError, match="micro_batch_tokens") as info:
        load_critic_config(["--config-name", "ppo_critic_demo", *overrides])
    assert words in str(info.value)


@pytest.mark.parametrize(
    "version, too_old",
    [("2.3.0", True), ("2.1.0rc1", True), ("1.4.1", True), ("2.4.0", False), ("2.4.0.dev3", False), ("3.0", False)],
)
def test_an_omegaconf_before_2_4_is_named_with_the_fix(version, too_old):
    why = omegaconf_too_old(version)
    assert (why is not None) == too_old
    if too_old:
        assert f"omegaconf {version} is installed" in why and "pip install 'omegaconf>=2.4'" in why


def test_a_job_under_an_old_omegaconf_says_so_in_one_line_and_exits_2():
    # The installed omegaconf (>= 2.4, setup.py) reads the schemas; one that reports 2.3.0 (a real 2.3 rejects the
    # schemas' Literal fields with a traceback) gets the loader's one line before any schema is built. The job
    # script runs in a process of its own, its omegaconf's version string set to 2.3.0.
    import omegaconf

    assert omegaconf_too_old(omegaconf.__version__) is None
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        "import omegaconf, runpy, sys; omegaconf.__version__ = '2.3.0'; "
        "sys.argv = ['train_sft.py', '--config-name', 'sft_demo']; "
        f"runpy.run_path({os.path.join(repo, 'scripts', 'train_sft.py')!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=repo)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "omegaconf 2.3.0 is installed" in lines[0] and "omegaconf>=2.4" in lines[0], lines
