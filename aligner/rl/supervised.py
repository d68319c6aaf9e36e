"""Losses of the supervised trainers: SFT's masked next-token NLL, the reward model's Bradley-Terry loss and DPO
(sigmoid with label smoothing, or IPO). Pure tensor functions; no collective unless a group is passed.

Contract (as in aligner.rl.losses)
- Reduction: each loss returns `sum(per-unit loss) / count_global`, where the unit is a target token (SFT) or a
  preference pair (RM, DPO) and `count_global` counts the units of the whole global batch (all micro-batches on all
  DP ranks). Summing micro-batch losses and SUM-reducing gradients over DP then gives exactly the full-batch mean.
- Metrics: `(loss, stats)`; `stats` holds detached 0-dim float64 tensors named in aligner.rl.stats' convention: a
  count (`tokens` for SFT, `pairs` for RM and DPO) and `<name>_sum`; `reduce_stats(stats, group, count="pairs")`
  turns them into means.
- Pairs: `chosen_B` and `rejected_B` hold one number per pair (a reward, or a sequence's summed log-prob).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _denominator(count_global):
    # With nothing to average every numerator is 0; dividing by 1 keeps the loss 0 instead of NaN.
    if isinstance(count_global, torch.Tensor):
        return count_global.clamp_min(1)
    return max(count_global, 1)


def _detached(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to(torch.float64)


def nll_loss(
    logp_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens_global: int | float | torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SFT: mean negative log-likelihood of the masked target tokens (`logp_BT[b, t]` = log p(token t+1 | ...)).

    stats: `tokens` (masked targets of this micro-batch), `nll_sum`."""
    keep_BT = mask_BT.bool()
    # torch.where rather than a product with the mask: a -inf log-prob on a padding position must not give NaN.
    nll_BT = torch.where(keep_BT, -logp_BT, 0.0)
    loss = nll_BT.sum() / _denominator(num_tokens_global)
    return loss, {"tokens": keep_BT.sum().to(torch.float64), "nll_sum": _detached(nll_BT.sum())}


def sequence_logprobs(logp_BT: torch.Tensor, mask_BT: torch.Tensor, average: bool = False) -> torch.Tensor:
    """Per-sequence log-prob [B]: the sum (or with `average`, the mean) of `logp_BT` over the masked positions."""
    keep_BT = mask_BT.bool()
    total_B = torch.where(keep_BT, logp_BT, 0.0).sum(-1)
    return total_B / keep_BT.sum(-1).clamp_min(1) if average else total_B


def _pair_stats(loss_B, chosen_B, rejected_B) -> dict[str, torch.Tensor]:
    return {
        "pairs": torch.tensor(float(loss_B.numel()), dtype=torch.float64, device=loss_B.device),
        "loss_sum": _detached(loss_B.sum()),
        # a tie is not a win: a reward model (or policy) that cannot tell the two apart scores 0
        "accuracy_sum": _detached((chosen_B > rejected_B).sum()),
        "chosen_sum": _detached(chosen_B.sum()),
        "rejected_sum": _detached(rejected_B.sum()),
        "margin_sum": _detached((chosen_B - rejected_B).sum()),
    }


def bradley_terry_loss(
    chosen_B: torch.Tensor, rejected_B: torch.Tensor, num_pairs_global: int | float | torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Reward model: -log sigmoid(r_chosen - r_rejected), summed over pairs / `num_pairs_global`.

    d loss / d r_chosen = -sigmoid(r_rejected - r_chosen) / N = -d loss / d r_rejected.
    stats: `pairs`, `loss_sum`, `accuracy_sum` (r_chosen > r_rejected), `chosen_sum`, `rejected_sum`, `margin_sum`
    (rewards, not log-probs)."""
    chosen_B, rejected_B = chosen_B.float(), rejected_B.float()
    loss_B = -F.logsigmoid(chosen_B - rejected_B)
    return loss_B.sum() / _denominator(num_pairs_global), _pair_stats(loss_B, chosen_B, rejected_B)


def dpo_loss(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    reference_chosen_B: torch.Tensor,
    reference_rejected_B: torch.Tensor,
    num_pairs_global: int | float | torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str = "sigmoid",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO on sequence log-probs (sums or means over response tokens, from `sequence_logprobs`).

    h = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected), the implicit reward margin before beta.
    - `sigmoid` (Rafailov et al. 2023), with label smoothing eps (conservative DPO: the label is flipped with
      probability eps): loss = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    - `ipo` (Azar et al. 2023): loss = (h - 1 / (2 beta))^2.
    Summed over pairs / `num_pairs_global`. The reference terms carry no gradient.
    stats: `pairs`, `loss_sum`, `chosen_sum` / `rejected_sum` (implicit rewards beta (pi - ref)), `margin_sum`
    (their difference), `accuracy_sum` (chosen reward > rejected reward; 0 while policy == reference).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    chosen_ratio_B = policy_chosen_B.float() - reference_chosen_B.detach().float()
    rejected_ratio_B = policy_rejected_B.float() - reference_rejected_B.detach().float()
    h_B = chosen_ratio_B - rejected_ratio_B
    if loss_type == "sigmoid":
        loss_B = -(1.0 - label_smoothing) * F.logsigmoid(beta * h_B) - label_smoothing * F.logsigmoid(-beta * h_B)
    elif loss_type == "ipo":
        if label_smoothing:
            raise ValueError("label_smoothing applies to the sigmoid loss only")
        loss_B = (h_B - 1.0 / (2.0 * beta)).square()
    else:
        raise ValueError(f"loss_type must be 'sigmoid' or 'ipo', got {loss_type!r}")
    stats = _pair_stats(loss_B, beta * chosen_ratio_B, beta * rejected_ratio_B)
    return loss_B.sum() / _denominator(num_pairs_global), stats
