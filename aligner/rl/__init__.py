"""Pure RL maths shared by the actor loop and the critic job: rewards, GAE, whitening, KL, PPO losses, baselines,
advantage estimators; and the supervised trainers' losses (SFT NLL, Bradley-Terry, DPO: supervised.py).

Every function works on padded [B, T] tensors with `mask_BT` = 1 on response tokens (see each module's
docstring for the contract); collectives happen only when a process group is passed explicitly.
"""

from aligner.rl.advantages import (
    gae,
    last_token_index,
    masked_global_mean_var,
    masked_whiten,
    overlong_penalty,
    per_token_rewards,
    returns_to_go,
)
from aligner.rl.baselines import (
    constant_groups,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
    sample_to_tokens,
)
from aligner.rl.estimators import ESTIMATORS, AdvantageEstimator, make_estimator
from aligner.rl.kl import (
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    make_kl_controller,
)
from aligner.rl.losses import (
    entropy_from_logits,
    explained_variance,
    global_token_count,
    policy_loss,
    policy_loss_mask,
    value_loss,
)
from aligner.rl.stats import max_by_name, reduce_stats, sum_by_name
from aligner.rl.supervised import bradley_terry_loss, dpo_loss, nll_loss, sequence_logprobs

__all__ = [
    "ESTIMATORS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "constant_groups",
    "make_estimator",
    "overlong_penalty",
    "returns_to_go",
    "bradley_terry_loss",
    "dpo_loss",
    "nll_loss",
    "sequence_logprobs",
    "FixedKLController",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "global_token_count",
    "grpo_advantages",
    "kl_estimate",
    "last_token_index",
    "make_kl_controller",
    "max_by_name",
    "masked_global_mean_var",
    "masked_whiten",
    "per_token_rewards",
    "policy_loss",
    "policy_loss_mask",
    "reduce_stats",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "sample_to_tokens",
    "sum_by_name",
    "value_loss",
]
