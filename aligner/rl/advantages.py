"""Per-token rewards, GAE and advantage whitening over padded [B, T] tensors.

Contract
- Alignment: position t holds the quantity of the token at t (its log-prob, its value, its reward).
- `mask_BT` (bool or float 0/1) is 1 on response tokens, the EOS included, and 0 on prompt and padding positions.
  A response is one contiguous run of ones per row; the last one is the EOS, or the last generated token when the
  response was cut at the length limit.
- Outputs are exactly 0 at masked positions, whatever the inputs hold there (padding values may be garbage).
- `group` is the process group to reduce statistics over (the data-parallel group); `None` means local only.
- Order in a PPO step: rewards = per_token_rewards(...); advantages, returns = gae(...) (returns are taken before
  whitening); advantages = masked_whiten(advantages, mask, group).
"""

from __future__ import annotations

import torch

from aligner.rl._dist import all_reduce_

WHITEN_EPS = 1e-8


def _float_dtype(x: torch.Tensor) -> torch.dtype:
    # Recursions and statistics in at least fp32: bf16 rewards summed over hundreds of tokens lose too much.
    return torch.promote_types(x.dtype, torch.float32)


def last_token_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """Index [B] of the last position where `mask_BT` is 1 (0 for a row with no response token)."""
    T = mask_BT.shape[-1]
    positions_BT = torch.arange(T, device=mask_BT.device).expand_as(mask_BT)
    return torch.where(mask_BT.bool(), positions_BT, torch.zeros_like(positions_BT)).amax(dim=-1)


def per_token_rewards(
    scores_B: torch.Tensor,
    kl_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    kl_coef: float,
    score_clip: float | None = None,
) -> torch.Tensor:
    """Rewards [B, T]: `-kl_coef * kl_BT` on every response token plus the score on the last response token.

    `scores_B` is the reward-model score per sample; with `score_clip` it is clipped to [-score_clip, score_clip]
    first. A row without response tokens gets no reward at all.
    """
    dtype = _float_dtype(kl_BT)
    mask_BT = mask_BT.bool()
    scores_B = scores_B.to(dtype).reshape(-1)
    if score_clip is not None:
        scores_B = scores_B.clamp(-score_clip, score_clip)
    rewards_BT = torch.where(mask_BT, -kl_coef * kl_BT.to(dtype), torch.zeros((), dtype=dtype, device=kl_BT.device))
    has_response_B = mask_BT.any(dim=-1)
    rows_B = torch.arange(rewards_BT.shape[0], device=rewards_BT.device)
    rewards_BT[rows_B, last_token_index(mask_BT)] += torch.where(has_response_B, scores_B, 0.0)
    return rewards_BT


def gae(
    values_BT: torch.Tensor,
    rewards_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation inside each row over response tokens; returns (advantages_BT, returns_BT).

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is the next
    response token of the same row; after the last response token V_next = 0 and A_next = 0, so nothing leaks in
    from padding or from the following row. returns = advantages + values (before any whitening).
    Masked positions are skipped (carried through), so prompt positions are ignored; both outputs are 0 there.
    Vectorised over B, a Python loop over T.
    """
    dtype = torch.promote_types(_float_dtype(values_BT), rewards_BT.dtype)
    keep_BT = mask_BT.bool()
    zero = torch.zeros((), dtype=dtype, device=values_BT.device)
    # torch.where, not multiplication: a NaN/inf value at a padding position must not reach the result.
    values_BT = torch.where(keep_BT, values_BT.to(dtype), zero)
    rewards_BT = torch.where(keep_BT, rewards_BT.to(dtype), zero)

    B, T = values_BT.shape
    advantages_BT = torch.zeros((B, T), dtype=dtype, device=values_BT.device)
    next_value_B = torch.zeros(B, dtype=dtype, device=values_BT.device)
    next_adv_B = torch.zeros(B, dtype=dtype, device=values_BT.device)
    for t in reversed(range(T)):
        keep_B = keep_BT[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        advantages_BT[:, t] = torch.where(keep_B, adv_B, zero)
        next_adv_B = torch.where(keep_B, adv_B, next_adv_B)
        next_value_B = torch.where(keep_B, values_BT[:, t], next_value_B)
    returns_BT = advantages_BT + values_BT
    return advantages_BT, returns_BT


def returns_to_go(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """sum_{k >= t} gamma^(k - t) r_k over the response tokens of each row; 0 at masked positions."""
    # GAE with a zero critic and lambda = 1 is exactly the discounted return-to-go.
    _, returns_BT = gae(torch.zeros_like(rewards_BT), rewards_BT, mask_BT, gamma=gamma, lam=1.0)
    return returns_BT


def overlong_penalty(
    response_lengths_B: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), float32 [B], added to the scores.

    0 for a response of at most `max_length - buffer` tokens, then falling linearly with each further token to
    -factor at `max_length` (the generation limit: a response never exceeds it, so -factor is the floor).
    """
    if not 0 < buffer <= max_length:
        raise ValueError(f"buffer must be in 1..max_length={max_length}, got {buffer}")
    excess_B = (response_lengths_B.to(torch.float32) - (max_length - buffer)).clamp(min=0.0) / buffer
    return -factor * excess_B.clamp(max=1.0)


def masked_global_mean_var(
    x_BT: torch.Tensor, mask_BT: torch.Tensor, group=None, unbiased: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and variance of `x_BT` over the positions where `mask_BT` is 1, across all ranks of `group`.

    Returns 0-dim float64 tensors. Two passes (sum and count, then the centred sum of squares), each one all-reduce
    in float64, so the result does not depend on how the tokens are split over ranks, up to rounding.
    The variance is the population one (divide by N), as NeMo-Aligner's `masked_global_mean_var`;
    `unbiased=True` applies Bessel's correction (N - 1). With no valid token anywhere, both are NaN.
    """
    keep_BT = mask_BT.bool()
    x_BT = torch.where(keep_BT, x_BT.detach().to(torch.float64), 0.0)
    sum_count = torch.stack([x_BT.sum(), keep_BT.sum().to(torch.float64)])
    all_reduce_(sum_count, group)
    total, count = sum_count[0], sum_count[1]
    mean = total / count
    centred_sq = torch.where(keep_BT, (x_BT - mean).square(), 0.0).sum()
    all_reduce_(centred_sq, group)
    var = centred_sq / (count - 1 if unbiased else count)
    return mean, var


def masked_whiten(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    group=None,
    shift_mean: bool = True,
    eps: float = WHITEN_EPS,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the masked statistics of `masked_global_mean_var` over `group`.

    With `shift_mean=False` the mean is added back, as in TRL/OpenRLHF's `whiten`: the result keeps the original
    mean and gets unit std. Masked positions are 0; the result has the dtype of `x_BT` and no gradient.
    """
    mean, var = masked_global_mean_var(x_BT, mask_BT, group)
    whitened_BT = (x_BT.detach().to(torch.float64) - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened_BT = whitened_BT + mean
    return torch.where(mask_BT.bool(), whitened_BT, 0.0).to(x_BT.dtype)
