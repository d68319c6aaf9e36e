"""The reward-model job's config schema (`conf/reward_model.yaml`; shared sections: aligner/config/train.py).

Rows: `prompt` (or `messages`), `chosen`, `rejected`. The model is a scalar-head GPT read at each sequence's last
token (the critic job's reward-model contract), trained with the Bradley-Terry loss. `model.checkpoint` may be a
policy (e.g. the SFT checkpoint: its backbone is loaded, the head starts fresh) or a reward model.
`reward_stats`: every checkpoint carries `reward_stats.json` (mean and std of the model's rewards on the chosen and
rejected responses of `reward_stats.file`), which the critic job reads to standardise rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from aligner.config.critic import resolve_file
from aligner.config.rules import check
from aligner.config.train import TrainDataConfig, TrainJobConfig, load_train_config


@dataclass
class PreferenceDataConfig(TrainDataConfig):
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"


@dataclass
class RewardStatsConfig:
    file: Optional[str] = None  # preference rows whose responses are scored; None = data.train_file
    max_examples: int = 1024  # pairs scored (2 rewards each)


@dataclass
class RewardModelJobConfig(TrainJobConfig):
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    reward_stats: RewardStatsConfig = field(default_factory=RewardStatsConfig)
    exp_dir: str = "results/reward_model"

    def validate(self) -> None:
        super().validate()
        check(self.reward_stats.max_examples >= 1, "reward_stats.max_examples", "must be >= 1")

    def resolve_paths(self, config_dir: Optional[str] = None) -> None:
        super().resolve_paths(config_dir)
        self.reward_stats.file = resolve_file(self.reward_stats.file, "reward_stats.file", config_dir)


def load_reward_model_config(argv: Sequence[str], default_name: str = "reward_model") -> RewardModelJobConfig:
    return load_train_config(RewardModelJobConfig, argv, default_name)
