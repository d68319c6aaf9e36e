"""PPO policy and value losses over padded [B, T] micro-batches, reduced over the global token count.

Contract
- Alignment and mask as in `aligner.rl.advantages`: position t holds the quantity of the token at t; `mask_BT`
  (bool or float 0/1) is 1 on response tokens. Masked positions contribute exactly 0 to losses and gradients.
- Reduction: a loss returns `sum(per_token_loss * mask) / num_tokens_global`, where `num_tokens_global` is the
  number of valid tokens of the whole global mini-batch (all its micro-batches on all DP ranks), counted once by
  the caller with `global_token_count`. Summing the micro-batch losses (gradient accumulation without dividing by
  the number of micro-batches) and SUM-all-reducing gradients over DP then gives exactly the gradient of the
  full-batch token mean; a mean of per-micro-batch means would weight short micro-batches up.
  (A data-parallel wrapper that averages gradients over DP must be compensated by the caller: multiply by DP size.)
- Metrics: each loss returns `(loss, stats)`; `stats` is a flat dict of detached 0-dim float64 tensors:
  `tokens` (valid tokens of this micro-batch), `<name>_sum` (sum over valid tokens) and `<name>_max` (max over
  valid tokens, -inf when there is none). `reduce_stats(list_of_stats, group)` sums/maxes them over micro-batches
  and ranks and returns plain floats: `<name>` = total sum / total tokens, `<name>_max`, and `tokens`.
- Samples that never ended (cut at the length limit, no EOS): `policy_loss_mask(mask_BT, ended_B, zero_unended)`
  drops them from the policy loss (NeMo-Aligner's behaviour when `zero_unended=True`). Count `num_tokens_global`
  with the same mask that the loss uses.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aligner.rl._dist import all_reduce_
from aligner.rl.advantages import masked_global_mean_var
from aligner.rl.kl import kl_estimate

# Bound on |logp - logp_old| before exp(): a token whose probability collapsed cannot make the ratio inf
# (the clipped surrogate zeroes its gradient anyway when the advantage pushes it further out).
LOG_RATIO_CLAMP = 20.0


def global_token_count(masks: torch.Tensor | Iterable[torch.Tensor], group=None) -> int:
    """Number of valid tokens in `masks` (one mask or the masks of all micro-batches), summed over `group`.

    Call it once per global mini-batch on every rank of `group`. The single `.item()` host sync is deliberate:
    the count is needed as a number to scale every micro-batch loss of the mini-batch.
    """
    if isinstance(masks, torch.Tensor):
        masks = [masks]
    masks = list(masks)
    if not masks:
        raise ValueError("global_token_count needs at least one mask")
    count = torch.stack([m.to(torch.float64).sum() for m in masks]).sum()
    all_reduce_(count, group)
    return int(round(count.item()))


def policy_loss_mask(
    mask_BT: torch.Tensor, ended_B: torch.Tensor | None = None, zero_unended: bool = False
) -> torch.Tensor:
    """Float mask of the tokens that enter the policy loss: `mask_BT`, without unended samples if `zero_unended`."""
    keep_BT = mask_BT.bool()
    if zero_unended:
        if ended_B is None:
            raise ValueError("zero_unended=True needs ended_B")
        keep_BT = keep_BT & ended_B.bool().reshape(-1, 1)
    return keep_BT.float()


def _denominator(num_tokens_global: int | float | torch.Tensor):
    # With no valid token anywhere every numerator is 0; dividing by 1 keeps the loss 0 instead of NaN.
    if isinstance(num_tokens_global, torch.Tensor):
        return num_tokens_global.clamp_min(1)
    return max(num_tokens_global, 1)


def _stats(keep_BT: torch.Tensor, sums: dict, maxes: dict) -> dict[str, torch.Tensor]:
    out = {"tokens": keep_BT.sum().to(torch.float64)}
    for name, x_BT in sums.items():
        out[f"{name}_sum"] = torch.where(keep_BT, x_BT.detach().to(torch.float64), 0.0).sum()
    for name, x_BT in maxes.items():
        out[f"{name}_max"] = torch.where(keep_BT, x_BT.detach().to(torch.float64), -torch.inf).amax()
    return out


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens_global: int | float | torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ended_B: torch.Tensor | None = None,
    zero_unended: bool = False,
    ref_logp_BT: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    rollout_logp_BT: torch.Tensor | None = None,
    rollout_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate (+ optional dual clip, KL term and entropy bonus) for one micro-batch.

    ratio = exp(clamp(logp - logp_old, ±20)); per token, pg = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))
    (`clip_eps_high` defaults to `clip_eps`). Dual clip (Ye et al. 2020, c = `dual_clip` > 1): for A < 0,
    pg = min(pg, c * |A|), bounding the loss of a token whose ratio has exploded. Per-token loss =
    pg + kl_coef * kl_estimate(logp_BT, ref_logp_BT, kl_estimator) - entropy_coef * entropy_BT (`entropy_BT` is
    the per-token entropy, from `entropy_from_logits` or a vocab-parallel version). The KL term is GRPO's KL to the
    reference as a loss (DeepSeekMath: k3, differentiated through logp_BT); given `ref_logp_BT` it is also reported
    with kl_coef = 0. Returns `(loss, stats)` with loss = sum(loss_token * m) / num_tokens_global, m being
    `policy_loss_mask(mask_BT, ended_B, zero_unended)`.
    stats sums: pg_loss, entropy (if given), kl_loss (the KL estimate, if ref_logp_BT is given), clipfrac (tokens
    whose clipped term was the active one), dual_clipfrac (if dual clip), approx_kl (k3 estimate of
    KL(old || new): ratio - 1 - log ratio), ratio; max: ratio.
    Rollout correction (truncated importance sampling, Yao et al. 2025), with `rollout_weight_cap` C and the
    log-probs of the engine that drew the tokens, `rollout_logp_BT`: each token's policy-gradient term is weighted
    by w = min(exp(logp_old - logp_rollout), C) (detached), for rollouts drawn by a policy other than the one trained
    (FP8 decode weights, another engine's numerics). Adds stats is_weight (sum and max).
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    keep_BT = policy_loss_mask(mask_BT, ended_B, zero_unended).bool()
    advantages_BT = advantages_BT.detach()

    log_ratio_BT = (logp_BT - old_logp_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_BT = torch.exp(log_ratio_BT)
    surr1_BT = -advantages_BT * ratio_BT
    surr2_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_eps, 1.0 + eps_high)
    pg_BT = torch.maximum(surr1_BT, surr2_BT)
    clipped_BT = surr2_BT > surr1_BT
    sums = {}
    if dual_clip is not None:
        bound_BT = -advantages_BT * dual_clip  # = c * |A| where A < 0
        dual_BT = (advantages_BT < 0) & (pg_BT > bound_BT)
        pg_BT = torch.where(dual_BT, bound_BT, pg_BT)
        sums["dual_clipfrac"] = dual_BT
    maxes = {"ratio": ratio_BT}
    if rollout_weight_cap is not None:
        if rollout_logp_BT is None:
            raise ValueError("rollout_weight_cap needs rollout_logp_BT")
        log_w_BT = (old_logp_BT.detach() - rollout_logp_BT.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        weight_BT = torch.exp(log_w_BT).clamp(max=rollout_weight_cap)
        pg_BT = pg_BT * weight_BT
        sums["is_weight"] = maxes["is_weight"] = weight_BT
    loss_BT = pg_BT
    if ref_logp_BT is not None:
        kl_BT = kl_estimate(logp_BT, ref_logp_BT.detach(), kl_estimator)
        if kl_coef != 0.0:
            loss_BT = loss_BT + kl_coef * kl_BT
        sums["kl_loss"] = kl_BT
    elif kl_coef != 0.0:
        raise ValueError("kl_coef needs ref_logp_BT")
    if entropy_BT is not None:
        if entropy_coef != 0.0:
            loss_BT = loss_BT - entropy_coef * entropy_BT
        sums["entropy"] = entropy_BT

    # torch.where rather than a product with the mask: a NaN in a padding position must not reach the gradient.
    loss = torch.where(keep_BT, loss_BT, 0.0).sum() / _denominator(num_tokens_global)
    with torch.no_grad():
        sums.update(
            pg_loss=pg_BT,
            clipfrac=clipped_BT,
            approx_kl=ratio_BT - 1.0 - log_ratio_BT,
            ratio=ratio_BT,
        )
        stats = _stats(keep_BT, sums, maxes)
    return loss, stats


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    num_tokens_global: int | float | torch.Tensor,
    clip_eps: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss for one micro-batch: 0.5 * max((V - R)², (clip(V, V_old ± eps) - R)²), token-reduced.

    `clip_eps=None` gives the plain 0.5 * (V - R)². Returns `(loss, stats)` with
    loss = sum(loss_token * mask) / num_tokens_global; stats sums: vf_loss, vf_clipfrac (tokens whose clipped
    term was the larger one), value (mean prediction); max: value_error (|V - R|).
    """
    keep_BT = mask_BT.bool()
    returns_BT = returns_BT.detach()
    loss_unclipped_BT = (values_BT - returns_BT).square()
    if clip_eps is None:
        loss_BT = 0.5 * loss_unclipped_BT
        clipped_BT = torch.zeros_like(keep_BT)
    else:
        old_values_BT = old_values_BT.detach()
        values_clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_eps, clip_eps)
        loss_clipped_BT = (values_clipped_BT - returns_BT).square()
        loss_BT = 0.5 * torch.maximum(loss_unclipped_BT, loss_clipped_BT)
        clipped_BT = loss_clipped_BT > loss_unclipped_BT
    loss = torch.where(keep_BT, loss_BT, 0.0).sum() / _denominator(num_tokens_global)
    with torch.no_grad():
        stats = _stats(
            keep_BT,
            {"vf_loss": loss_BT, "vf_clipfrac": clipped_BT, "value": values_BT},
            {"value_error": (values_BT - returns_BT).abs()},
        )
    return loss, stats


def explained_variance(
    values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor, group=None
) -> torch.Tensor:
    """1 - Var[R - V] / Var[R] over the masked tokens of all ranks of `group` (0-dim float64).

    1 is a perfect critic, 0 one that predicts the mean, negative worse than that; NaN when Var[R] is 0.
    """
    _, var_err = masked_global_mean_var(returns_BT - values_BT, mask_BT, group)
    _, var_ret = masked_global_mean_var(returns_BT, mask_BT, group)
    return 1.0 - var_err / var_ret


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Entropy [B, T] (nats) of softmax(logits) over the last dim, for full-vocabulary logits on one rank.

    Computed as logsumexp(z) - sum(softmax(z) * z), stable for large logits; fp32 at least. Logits of -inf
    (tokens filtered out) contribute 0 rather than 0 * -inf = NaN.
    """
    logits_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    p_logit_BTV = torch.where(probs_BTV > 0, probs_BTV * logits_BTV, 0.0)
    return torch.logsumexp(logits_BTV, dim=-1) - p_logit_BTV.sum(dim=-1)
