"""KL between the policy and the reference: per-token estimators and the KL-coefficient controllers.

Contract
- `kl_estimate(logp_BT, ref_logp_BT, ...)` takes the log-probs of the *sampled* tokens under the policy and the
  reference, same shape (any shape, typically [B, T]), and returns a per-token estimate of KL(policy || reference)
  with Δ = logp - ref_logp:
    k1 = Δ                    unbiased, can be negative
    k2 = 0.5 * Δ²             biased, non-negative, low variance
    k3 = exp(-Δ) - 1 + Δ      unbiased, non-negative (Schulman's "approximating KL")
  No mask is applied here: callers multiply by their response mask (padding log-probs may be anything).
- Controllers hold the coefficient `value` (beta). `update(current_kl, n_steps)` is called once per PPO step
  with the measured KL in the units of the controller's `target` and the number of samples of that step: per
  sample (the KL summed over a response's tokens, averaged over the samples: Ziegler et al.'s unit, whose target
  of 6 nats is the config default) or per token (averaged over response tokens). A per-sample target fed a
  per-token KL reads a KL ~response-length times too small, so beta could only shrink.
  `state_dict`/`load_state_dict` save and restore the coefficient so that a resumed run continues with the same
  beta.
"""

from __future__ import annotations

import torch

# Δ is clamped before exp() so that a wildly off token cannot produce inf (exp(20) ~ 5e8 is still finite in fp32),
# and k3 is clamped afterwards, as peers (veRL, OpenRLHF) do, so one token cannot dominate the penalty.
LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0

ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(
    logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str = "k1", use_absolute_kl: bool = False
) -> torch.Tensor:
    """Per-token KL(policy || reference) estimate, same shape as the inputs.

    `use_absolute_kl` (NeMo-Aligner's option) takes |k1|; it changes nothing for k2 and k3, which are >= 0.
    """
    delta_BT = logp_BT - ref_logp_BT
    if estimator == "k1":
        kl_BT = delta_BT
    elif estimator == "k2":
        kl_BT = 0.5 * delta_BT.square()
    elif estimator == "k3":
        delta_BT = delta_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_BT = (torch.exp(-delta_BT) - 1.0 + delta_BT).clamp(-K3_CLAMP, K3_CLAMP)
    else:
        raise ValueError(f"kl estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if use_absolute_kl:
        kl_BT = kl_BT.abs()
    return kl_BT


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt; present so both controllers are called the same way."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences", eq. 2).

    error = clip(current_kl / target - 1, -0.2, 0.2);  value *= 1 + error * n_steps / horizon.
    The clip bounds how fast beta moves when the measured KL is far from the target. `current_kl` must be in the
    units of `target`: the paper's are nats per sample (the KL summed over a response).
    """

    ERROR_CLIP = 0.2

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef}")
        if target <= 0:
            raise ValueError(f"target must be > 0, got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -self.ERROR_CLIP), self.ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


def make_kl_controller(
    kl_coef: float, adaptive: bool = False, target: float | None = None, horizon: int | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the controller a config asks for; `target` and `horizon` are required when `adaptive`."""
    if not adaptive:
        return FixedKLController(kl_coef)
    if target is None or horizon is None:
        raise ValueError("an adaptive KL controller needs both target and horizon")
    return AdaptiveKLController(kl_coef, target, horizon)
