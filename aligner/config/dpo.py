"""The DPO job's config schema (`conf/dpo.yaml`; shared sections: aligner/config/train.py).

Rows as for the reward model (`prompt` or `messages`, `chosen`, `rejected`). The policy starts from
`model.checkpoint` (normally the SFT checkpoint); the reference is the policy's starting weights, either `resident`
(a frozen copy on the device, run beside the policy every step) or `precomputed` (its sequence log-probs for every
training and validation pair computed once before training, with the policy itself: no second model in memory; a
resumed run recomputes them from the starting weights before loading its checkpoint).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Sequence

from aligner.config.reward_model import PreferenceDataConfig
from aligner.config.rules import check
from aligner.config.train import TrainJobConfig, load_train_config


@dataclass
class DPOConfig:
    beta: float = 0.1  # strength of the implicit KL to the reference
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid only: probability that a preference label is flipped (conservative DPO)
    average_logprobs: bool = False  # mean instead of sum of response-token log-probs (length-normalised; IPO paper)
    reference: Literal["resident", "precomputed"] = "resident"


@dataclass
class DPOJobConfig(TrainJobConfig):
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    exp_dir: str = "results/dpo"

    def validate(self) -> None:
        super().validate()
        d = self.dpo
        check(math.isfinite(d.beta) and d.beta > 0, "dpo.beta", f"must be > 0, got {d.beta}")
        check(0 <= d.label_smoothing < 0.5, "dpo.label_smoothing", f"must lie in [0, 0.5), got {d.label_smoothing}")
        check(
            d.loss == "sigmoid" or d.label_smoothing == 0,
            "dpo.label_smoothing",
            "applies to dpo.loss=sigmoid only; set it to 0 for ipo",
        )


def load_dpo_config(argv: Sequence[str], default_name: str = "dpo") -> DPOJobConfig:
    return load_train_config(DPOJobConfig, argv, default_name)
