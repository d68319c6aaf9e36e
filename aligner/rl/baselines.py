"""Critic-free advantage baselines: GRPO, RLOO and REINFORCE++.

Contract
- Per-sample functions take `scores_B`, one scalar score per sample, with the `group_size` samples drawn for the
  same prompt stored next to each other: sample i belongs to group i // group_size, B = n_groups * group_size.
  They return per-sample advantages [B]; `sample_to_tokens` spreads them over the response tokens.
- Token-level functions follow the [B, T] conventions of `aligner.rl.advantages` (mask 1 on response tokens,
  0 outputs at masked positions, `group` = process group for global statistics, None = local).
"""

from __future__ import annotations

import torch

from aligner.rl.advantages import masked_whiten, returns_to_go


def _grouped(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    scores_B = scores_B.reshape(-1)
    if scores_B.numel() % group_size:
        raise ValueError(f"batch of {scores_B.numel()} samples is not a multiple of group_size={group_size}")
    return scores_B.to(torch.promote_types(scores_B.dtype, torch.float32)).reshape(-1, group_size)


def grpo_advantages(
    scores_B: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024): (s - group mean) / (group std + eps), or s - group mean without `normalize_std`.

    The std is the sample one (Bessel, N - 1), as in DeepSeekMath and TRL. A group of identical scores gives 0.
    """
    scores_GN = _grouped(scores_B, group_size)
    adv_GN = scores_GN - scores_GN.mean(dim=1, keepdim=True)
    if normalize_std:
        adv_GN = adv_GN / (scores_GN.std(dim=1, keepdim=True) + eps)
    return adv_GN.reshape(-1)


def rloo_advantages(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): s_i minus the mean score of the other samples of its group."""
    scores_GN = _grouped(scores_B, group_size)
    baseline_GN = (scores_GN.sum(dim=1, keepdim=True) - scores_GN) / (group_size - 1)
    return (scores_GN - baseline_GN).reshape(-1)


def constant_groups(scores_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """bool [n_groups]: True where every score of the group is the same (its group baseline gives 0 advantage:
    DAPO's dynamic sampling drops such groups; `rollout/zero_std_group_fraction` counts them)."""
    scores_GN = _grouped(scores_B, group_size)
    return (scores_GN == scores_GN[:, :1]).all(dim=1)


def sample_to_tokens(x_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: the sample's value on each of its response tokens, 0 elsewhere."""
    return torch.where(mask_BT.bool(), x_B.reshape(-1, 1), torch.zeros((), dtype=x_B.dtype, device=x_B.device))


def reinforce_pp_advantages(
    rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): token returns, then whitened over every response token of the global batch.

    `rewards_BT` are per-token rewards as from `per_token_rewards` (-beta * KL per token, score on the last token);
    for the "REINFORCE++-baseline" variant subtract the group mean from the scores first
    (`grpo_advantages(scores_B, group_size, normalize_std=False)`). returns_t = sum_{k >= t} gamma^(k-t) r_k within
    the response; advantages = masked_whiten(returns, mask, group). Returns (advantages_BT, returns_BT).
    """
    returns_BT = returns_to_go(rewards_BT, mask_BT, gamma)
    return masked_whiten(returns_BT, mask_BT, group), returns_BT
