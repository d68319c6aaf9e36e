"""KL estimators and controllers."""

import math

import pytest
import torch

from aligner.rl import AdaptiveKLController, FixedKLController, kl_estimate, make_kl_controller


def test_estimators_hand_values():
    # Δ = log 0.5 - log 0.25 = log 2
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    d = math.log(2.0)
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1.0 + d)  # exp(-Δ) - 1 + Δ
    # Swapped: Δ = -log 2
    assert kl_estimate(ref, logp, "k1").item() == pytest.approx(-d)
    assert kl_estimate(ref, logp, "k1", use_absolute_kl=True).item() == pytest.approx(d)
    assert kl_estimate(ref, logp, "k3").item() == pytest.approx(2.0 - 1.0 - d)


def test_identical_policies_give_exactly_zero():
    logp = torch.randn(3, 5, dtype=torch.float64)
    for est in ("k1", "k2", "k3"):
        assert (kl_estimate(logp, logp.clone(), est) == 0).all()


def test_k3_clamps():
    logp = torch.tensor([-40.0, 0.0, 0.0])
    ref = torch.tensor([0.0, -40.0, 0.0])
    k3 = kl_estimate(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    assert k3[0].item() == 10.0  # exp(20) - 21 clamped to 10
    assert k3[1].item() == 10.0  # Δ = 40 clamped to 20: exp(-20) - 1 + 20 ≈ 19, clamped to 10
    assert k3[2].item() == 0.0


def test_k1_and_k3_are_unbiased_for_categorical_kl():
    # The exact expectation under the policy: sum_i p_i * k(token i) must equal KL(p || q) for k1 and k3.
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    ref = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), 0)
    p = logp.exp()
    true_kl = (p * (logp - ref)).sum()
    for est in ("k1", "k3"):
        torch.testing.assert_close((p * kl_estimate(logp, ref, est)).sum(), true_kl)
    assert (p * kl_estimate(logp, ref, "k2")).sum() > 0


def test_unknown_estimator():
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 512)
    assert c.value == 0.05
    c2 = FixedKLController(0.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == 0.05


def test_adaptive_controller_updates_and_clips():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(12.0, 256)  # error 1.0 clipped to 0.2
    assert c.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    v = c.value
    c.update(6.6, 100)  # error 0.1, inside the clip
    assert c.value == pytest.approx(v * (1 + 0.1 * 100 / 10000))
    v = c.value
    c.update(6.0, 100)  # on target: unchanged
    assert c.value == pytest.approx(v)
    c.update(0.0, 1000)  # error -1 clipped to -0.2
    assert c.value == pytest.approx(v * (1 - 0.2 * 1000 / 10000))


def test_adaptive_controller_resume():
    a = AdaptiveKLController(0.2, target=3.0, horizon=1000)
    for kl in (1.0, 5.0, 2.5):
        a.update(kl, 64)
    b = AdaptiveKLController(0.9, target=1.0, horizon=5)
    b.load_state_dict(a.state_dict())
    a.update(4.0, 64)
    b.update(4.0, 64)
    assert a.value == b.value and b.target == 3.0 and b.horizon == 1000


def test_make_kl_controller():
    assert isinstance(make_kl_controller(0.1), FixedKLController)
    c = make_kl_controller(0.1, adaptive=True, target=6.0, horizon=10000)
    assert isinstance(c, AdaptiveKLController) and c.value == 0.1
    with pytest.raises(ValueError):
        make_kl_controller(0.1, adaptive=True)


def test_adaptive_controller_trajectory_in_matching_units():
    """Five steps of 8 responses of 20 tokens each, with hand-made KL sums over all 160 response tokens. Per sample
    (Ziegler et al.'s unit, kl_sum / 8) beta follows the hand-computed trajectory; fed the per-token mean instead
    (kl_sum / 160, 20x smaller) against the same per-sample target, the error is clipped at -0.2 every step and
    beta can only shrink; a per-token target (0.3 = 6 / 20) fed per-token KL moves exactly as the per-sample one."""
    kl_sums = [48.0, 96.0, 24.0, 52.8, 0.0]  # per sample: 6, 12, 3, 6.6, 0 nats
    c = AdaptiveKLController(0.1, target=6.0, horizon=80)
    trajectory = []
    for kl_sum in kl_sums:
        c.update(kl_sum / 8, 8)
        trajectory.append(c.value)
    # errors 0, +0.2 (clipped from 1), -0.2 (clipped from -0.5), +0.1, -0.2 (clipped from -1); n / horizon = 0.1
    assert trajectory == pytest.approx([0.1, 0.102, 0.09996, 0.1009596, 0.098940408], rel=1e-9)

    wrong = AdaptiveKLController(0.1, target=6.0, horizon=80)
    for kl_sum in kl_sums:
        wrong.update(kl_sum / 160, 8)
    assert wrong.value == pytest.approx(0.1 * 0.98**5), "per-token KL against a per-sample target only shrinks beta"

    per_token = AdaptiveKLController(0.1, target=0.3, horizon=80)
    for kl_sum in kl_sums:
        per_token.update(kl_sum / 160, 8)
    assert per_token.value == pytest.approx(trajectory[-1], rel=1e-12)
