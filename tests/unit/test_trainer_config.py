"""The trainers' configs (aligner/config/{train,sft,reward_model,dpo}.py) and the critic reading a reward model's
reward_stats.json: demo recipes load, each rule names its key, torch is never imported."""

import json
import os
import subprocess
import sys

import pytest

from aligner.config import ConfigError
from aligner.config.critic import CriticJobConfig
from aligner.config.dpo import load_dpo_config
from aligner.config.reward_model import load_reward_model_config
from aligner.config.schema import ModelConfig
from aligner.config.sft import load_sft_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOADERS = {"sft": load_sft_config, "reward_model": load_reward_model_config, "dpo": load_dpo_config}


@pytest.mark.parametrize("trainer", sorted(LOADERS))
def test_demo_recipes_load_and_take_files_and_exp_dir(trainer, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("{}\n")
    cfg = LOADERS[trainer](
        [f"--config-name={trainer}_demo", f"data.train_file={data}", f"data.val_file={data}", f"exp_dir={tmp_path}"]
    )
    assert cfg.data.train_file == cfg.data.val_file == str(data)
    assert cfg.exp_dir == str(tmp_path) and cfg.checkpoint_dir == str(tmp_path / "checkpoints")
    assert cfg.model.hidden_size == 64 and cfg.model.params_dtype == "float32"  # the tiny group over the 1B base
    assert os.path.isfile(cfg.tokenizer_path)
    assert cfg.validate_world(2) == 2


@pytest.mark.parametrize(
    "trainer, override, key",
    [
        ("sft", "train.global_batch_size=0", "train.global_batch_size"),
        ("sft", "data.max_length=4096", "data.max_length"),
        ("sft", "data.bad_rows=ignore", "data.bad_rows"),
        ("sft", "data.train_file=nowhere.jsonl", "data.train_file"),
        ("sft", "train.val_every=-1", "train.val_every"),
        ("sft", "data.packed_attention=flash", "data.packed_attention"),
        ("reward_model", "reward_stats.max_examples=0", "reward_stats.max_examples"),
        ("reward_model", "reward_stats.file=nowhere.jsonl", "reward_stats.file"),
        ("dpo", "dpo.beta=0", "dpo.beta"),
        ("dpo", "dpo.loss=hinge", "dpo.loss"),
        ("dpo", "dpo.reference=swap", "dpo.reference"),
        ("dpo", "dpo.label_smoothing=0.6", "dpo.label_smoothing"),
    ],
)
def test_bad_values_name_their_key(trainer, override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        LOADERS[trainer]([f"--config-name={trainer}_demo", override])


def test_label_smoothing_is_for_the_sigmoid_loss_only():
    with pytest.raises(ConfigError, match="dpo.label_smoothing.*sigmoid"):
        load_dpo_config(["--config-name=dpo_demo", "dpo.loss=ipo", "dpo.label_smoothing=0.1"])
    assert load_dpo_config(["--config-name=dpo_demo", "dpo.loss=ipo"]).dpo.loss == "ipo"


def test_varlen_packed_attention_needs_the_sdpa_core():
    with pytest.raises(ConfigError, match="data.packed_attention.*attention_backend=sdpa or auto.*unfused"):
        load_sft_config(["--config-name=sft_demo", "data.packed_attention=varlen", "model.attention_backend=unfused"])
    cfg = load_sft_config(["--config-name=sft_demo", "data.packed_attention=varlen", "data.packing=false"])
    assert cfg.data.packed_attention == "varlen"  # no packed rows: nothing to check
    assert load_sft_config(["--config-name=sft_demo"]).data.packed_attention == "auto"


def test_base_configs_need_data_and_a_tokenizer():
    with pytest.raises(ConfigError, match="'data.train_file'"):
        load_sft_config([])
    with pytest.raises(ConfigError, match="'data.tokenizer'"):
        load_sft_config([f"data.train_file={REPO}/conf/demo/sft_train.jsonl"])


def test_batch_layout_rules():
    cfg = load_reward_model_config(["--config-name=reward_model_demo", "train.micro_batch_size=5"])
    with pytest.raises(ConfigError, match="'train.global_batch_size'.*micro_batch_size=5"):
        cfg.validate_world(1)
    with pytest.raises(ConfigError, match="data-parallel size 3"):
        load_dpo_config(["--config-name=dpo_demo"]).validate_world(3)
    # SFT with packing counts packed rows per micro-batch: no divisibility rule against the sample count
    assert load_sft_config(["--config-name=sft_demo", "train.micro_batch_size=5"]).validate_world(2) == 2
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_sft_config(["--config-name=sft_demo", "train.micro_batch_size=5", "data.packing=false"]).validate_world(2)


def _critic(tmp_path, stats=None, **values):
    ckpt = tmp_path / "rm"
    ckpt.mkdir(parents=True, exist_ok=True)
    if stats is not None:
        (ckpt / "reward_stats.json").write_text(json.dumps(stats))
    return CriticJobConfig(reward_model=ModelConfig(checkpoint=str(ckpt)), **values)


def test_critic_reads_reward_stats_of_its_reward_model(tmp_path):
    cfg = _critic(tmp_path, {"reward_mean": 0.25, "reward_std": 4.0, "count": 10})
    cfg.validate()
    stats_file = str(tmp_path / "rm" / "reward_stats.json")
    assert cfg.reward_scaling() == (0.25, 4.0, stats_file)
    assert _critic(tmp_path, reward_mean=1.0).reward_scaling() == (1.0, 4.0, stats_file), "the config's value wins"
    assert _critic(tmp_path, reward_mean=1.0, reward_std=2.0).reward_scaling() == (1.0, 2.0, "the config")
    mean, std, source = _critic(tmp_path / "x", None).reward_scaling()
    assert (mean, std) == (0.0, 1.0) and "no reward_stats.json" in source, "no stats file: no standardisation"
    assert CriticJobConfig(reward_model=ModelConfig()).reward_scaling()[:2] == (0.0, 1.0)
    with pytest.raises(ConfigError, match="reward_stats.json"):
        _critic(tmp_path / "y", {"reward_mean": "x"}).reward_scaling()


def test_loading_a_trainer_config_imports_no_torch():
    code = (
        "import sys; from aligner.config.dpo import load_dpo_config; load_dpo_config(['--config-name=dpo_demo']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_local_launcher_checks_the_config_before_starting_anything(tmp_path):
    launcher = os.path.join(REPO, "launchers", "local", "train.py")
    args = ["--trainer", "dpo", "--procs", "2", f"exp_dir={tmp_path}/exp", "train.global_batch_size=5"]
    proc = subprocess.run([sys.executable, launcher, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "train.py: config error at 'train.global_batch_size': 5 is not divisible by the data-parallel size 2"
    )
    assert not (tmp_path / "exp").exists()
