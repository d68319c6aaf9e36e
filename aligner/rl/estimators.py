"""Advantage estimators, one per `ppo.advantage_estimator`, chosen once when the trainer is built.

Contract
- `make_estimator(name, group_size, gamma=1, lam=0.95, whiten=True, normalize_std=True, score_clip=None)` returns
  an estimator; `estimator(scores_B, kl_BT, mask_BT, kl_coef, values_BT=None, group=None)` returns
  `(advantages_BT, returns_BT)` on the [B, T] grid of `aligner.rl.advantages` (0 at masked positions).
  - `scores_B`: one score per sample. The `group_size` samples of one prompt are consecutive rows
    (`aligner.rl.baselines`), and all of a group's rows are on this rank: group baselines are computed locally.
  - `kl_BT`: per-token KL estimate of the rollout policy against the reference; `kl_coef` weighs it as a reward
    penalty (pass 0 when the KL is a loss term instead, `aligner.rl.losses.policy_loss(kl_coef=...)`).
  - `values_BT`: the critic's values, needed by `gae` alone (`estimator.uses_values`).
  - `group`: the process group of the whitening statistics (the data-parallel group); None = this rank only.
- Every estimator has the same three stages:
    1. a baseline on the scores (after clipping them to +-score_clip, if set):
         gae, reinforce_pp: none | grpo: (s - group mean) / (group std + eps), std optional | rloo: s minus the mean
         score of the other samples of its group;
    2. per-token rewards: -kl_coef * kl on each response token, plus the shaped score on the last one;
    3. token advantages: gae: GAE with the critic's values, whitened over `group` if `whiten` | grpo, rloo: the
       returns-to-go | reinforce_pp: the returns-to-go whitened over every response token of the batch (`group`).
  With kl_coef = 0 and gamma = 1, grpo and rloo give every response token its sample's shaped score.
  `returns_BT` are the returns before any whitening (for gae: advantages + values, the critic's target).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aligner.rl.advantages import gae, masked_whiten, per_token_rewards, returns_to_go
from aligner.rl.baselines import grpo_advantages, reinforce_pp_advantages, rloo_advantages

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")
GROUP_ESTIMATORS = ("grpo", "rloo")  # need several samples per prompt


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    group_size: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True  # gae only: reinforce_pp always whitens, grpo and rloo never do
    normalize_std: bool = True  # grpo only
    score_clip: float | None = None

    def __post_init__(self):
        if self.name not in ESTIMATORS:
            raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {self.name!r}")
        if self.name in GROUP_ESTIMATORS and self.group_size < 2:
            raise ValueError(f"{self.name} needs at least 2 samples per prompt, got group_size={self.group_size}")

    @property
    def uses_values(self) -> bool:
        return self.name == "gae"

    def shaped_scores(self, scores_B: torch.Tensor) -> torch.Tensor:
        """Stage 1: the scores after clipping and the group baseline, float32 or wider."""
        scores_B = scores_B.reshape(-1).to(torch.promote_types(scores_B.dtype, torch.float32))
        if self.score_clip is not None:
            scores_B = scores_B.clamp(-self.score_clip, self.score_clip)
        if self.name == "grpo":
            return grpo_advantages(scores_B, self.group_size, normalize_std=self.normalize_std)
        if self.name == "rloo":
            return rloo_advantages(scores_B, self.group_size)
        return scores_B

    def __call__(
        self,
        scores_B: torch.Tensor,
        kl_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        kl_coef: float,
        values_BT: torch.Tensor | None = None,
        group=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.uses_values and values_BT is None:
            raise ValueError("the gae estimator needs the critic's values")
        rewards_BT = per_token_rewards(self.shaped_scores(scores_B), kl_BT, mask_BT, kl_coef)
        if self.name == "gae":
            advantages_BT, returns_BT = gae(values_BT, rewards_BT, mask_BT, self.gamma, self.lam)
            if self.whiten:
                advantages_BT = masked_whiten(advantages_BT, mask_BT, group=group)
            return advantages_BT, returns_BT
        if self.name == "reinforce_pp":
            return reinforce_pp_advantages(rewards_BT, mask_BT, self.gamma, group=group)
        returns_BT = returns_to_go(rewards_BT, mask_BT, self.gamma)
        return returns_BT.clone(), returns_BT


def make_estimator(name: str, group_size: int = 1, **options) -> AdvantageEstimator:
    """The estimator `ppo.advantage_estimator` names; options: gamma, lam, whiten, normalize_std, score_clip."""
    return AdvantageEstimator(name, group_size, **options)
