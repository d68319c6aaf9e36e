"""PPO policy/value losses: hand values, masking, global-token reduction, gradients."""

import math

import pytest
import torch

from aligner.rl import (
    entropy_from_logits,
    explained_variance,
    global_token_count,
    policy_loss,
    policy_loss_mask,
    reduce_stats,
    value_loss,
)


def _ratios_to_logps(ratios):
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    return old + torch.log(torch.tensor([ratios], dtype=torch.float64)), old


def test_policy_loss_hand_values():
    # token 0: A=1, r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); token 1: A=-1, r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    # token 2: A=2, r=1 -> -2; token 3 is masked out.
    logp, old = _ratios_to_logps([1.5, 0.5, 1.0, 7.0])
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, stats = policy_loss(logp, old, adv, mask, num_tokens_global=3, clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    # The denominator is the global count, not this micro-batch's.
    loss6, _ = policy_loss(logp, old, adv, mask, num_tokens_global=6, clip_eps=0.2)
    assert loss6.item() == pytest.approx((-1.2 + 0.8 - 2.0) / 6)
    r = reduce_stats(stats)
    assert r["tokens"] == 3
    assert r["clipfrac"] == pytest.approx(2 / 3)
    assert r["ratio"] == pytest.approx(1.0)
    assert r["ratio_max"] == pytest.approx(1.5)
    assert r["pg_loss"] == pytest.approx((-1.2 + 0.8 - 2.0) / 3)
    expected_kl = sum(x - 1 - math.log(x) for x in (1.5, 0.5, 1.0)) / 3
    assert r["approx_kl"] == pytest.approx(expected_kl)


def test_policy_loss_asymmetric_clip():
    logp, old = _ratios_to_logps([1.5])
    adv = torch.ones(1, 1, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 1), 1, clip_eps=0.2, clip_eps_high=0.28)
    assert loss.item() == pytest.approx(-1.28)


def test_policy_loss_rollout_correction_hand_values():
    """Truncated importance sampling: w = min(p_old / p_engine, cap), detached, on each token's PG term only.
    Ratios 1 (on-policy update), A = [1, -2, 3]; engine log-probs make w = [0.5, 4 -> cap 2, 1]."""
    logp, old = _ratios_to_logps([1.0, 1.0, 1.0])
    logp.requires_grad_(True)
    engine = old - torch.log(torch.tensor([[0.5, 4.0, 1.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -2.0, 3.0]], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 3), 3, rollout_logp_BT=engine, rollout_weight_cap=2.0)
    assert loss.item() == pytest.approx((-1 * 0.5 + 2 * 2.0 - 3 * 1.0) / 3)
    loss.backward()  # d/dlogp of -A * ratio * w at ratio 1 (unclipped): -A * w / N; w carries no gradient
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 4.0, -3.0]], dtype=torch.float64) / 3)
    r = reduce_stats(stats)
    assert r["is_weight"] == pytest.approx((0.5 + 2.0 + 1.0) / 3) and r["is_weight_max"] == 2.0
    with pytest.raises(ValueError, match="rollout_logp_BT"):
        policy_loss(logp, old, adv, torch.ones(1, 3), 3, rollout_weight_cap=2.0)


def test_policy_loss_dual_clip():
    # A=-1, r=5: the clipped surrogate is max(5, 1.2) = 5, dual clip bounds it by c * |A| = 3.
    # A=-1, r=2: max(2, 1.2) = 2 < 3, untouched. A=+1, r=5: max(-5, -1.2) = -1.2, dual clip does not apply.
    logp, old = _ratios_to_logps([5.0, 2.0, 5.0])
    logp.requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 3), 3, clip_eps=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    assert reduce_stats(stats)["dual_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of -A * r / 3 is -A * r / 3 = 2/3 on the unclipped token; the two clipped ones carry no gradient.
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]], dtype=torch.float64))
    with pytest.raises(ValueError):
        policy_loss(logp, old, adv, torch.ones(1, 3), 3, dual_clip=0.5)


def test_policy_loss_entropy_bonus():
    logp, old = _ratios_to_logps([1.0, 1.0])
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    ent = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    base, _ = policy_loss(logp, old, adv, torch.ones(1, 2), 2)
    loss, stats = policy_loss(logp, old, adv, torch.ones(1, 2), 2, entropy_BT=ent, entropy_coef=0.1)
    assert loss.item() == pytest.approx(base.item() - 0.1 * 1.0)
    assert reduce_stats(stats)["entropy"] == pytest.approx(1.0)


def test_masked_positions_get_zero_loss_and_gradient():
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 6, generator=g, dtype=torch.float64)
    logp[0, 4:] = float("nan")  # padding garbage
    logp.requires_grad_(True)
    old = torch.randn(3, 6, generator=g, dtype=torch.float64)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    loss, _ = policy_loss(logp, old, adv, mask, global_token_count(mask))
    loss.backward()
    assert torch.isfinite(loss)
    assert (logp.grad[mask == 0] == 0).all()
    assert (logp.grad[mask == 1] != 0).any()
    # Changing masked inputs changes nothing.
    adv2 = adv.clone()
    adv2[mask == 0] = 1e6
    loss2, _ = policy_loss(logp, old, adv2, mask, global_token_count(mask))
    assert loss2.item() == loss.item()


def test_zero_unended_samples():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    old = torch.randn(2, 4, generator=g, dtype=torch.float64)
    adv = torch.randn(2, 4, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 4)
    ended = torch.tensor([True, False])
    m = policy_loss_mask(mask, ended, zero_unended=True)
    assert m.tolist() == [[1.0] * 4, [0.0] * 4]
    n = global_token_count(m)
    assert n == 4
    loss, stats = policy_loss(logp, old, adv, mask, n, ended_B=ended, zero_unended=True)
    only_first, _ = policy_loss(logp[:1], old[:1], adv[:1], mask[:1], 4)
    assert loss.item() == pytest.approx(only_first.item())
    assert stats["tokens"].item() == 4
    loss.backward()
    assert (logp.grad[1] == 0).all()
    # Off by default: the unended sample counts.
    loss_all, _ = policy_loss(logp, old, adv, mask, 8, ended_B=ended)
    assert loss_all.item() != pytest.approx(loss.item() / 2)
    with pytest.raises(ValueError):
        policy_loss_mask(mask, None, zero_unended=True)


def test_micro_batch_sum_equals_full_batch_mean():
    g = torch.Generator().manual_seed(2)
    B, T = 7, 9
    logp = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    old = logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T)
    for b, n in enumerate([9, 1, 4, 7, 2, 9, 5]):
        mask[b, T - n :] = 1
    full_in = logp.clone().requires_grad_(True)
    full, full_stats = policy_loss(full_in, old, adv, mask, int(mask.sum()), dual_clip=3.0)
    full.backward()
    # Uneven micro-batches; a mean of per-micro-batch means would differ.
    parts = [(0, 1), (1, 4), (4, 7)]
    n_global = global_token_count([mask[a:b] for a, b in parts])
    assert n_global == int(mask.sum())
    mb_in = logp.clone().requires_grad_(True)
    total, mb_stats = 0.0, []
    for a, b in parts:
        loss, st = policy_loss(mb_in[a:b], old[a:b], adv[a:b], mask[a:b], n_global, dual_clip=3.0)
        total = total + loss
        mb_stats.append(st)
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(mb_in.grad, full_in.grad)
    assert reduce_stats(mb_stats) == pytest.approx(reduce_stats(full_stats))
    mean_of_means = sum(
        policy_loss(logp[a:b], old[a:b], adv[a:b], mask[a:b], int(mask[a:b].sum()), dual_clip=3.0)[0].item()
        for a, b in parts
    ) / len(parts)
    assert mean_of_means != pytest.approx(full.item())


def test_policy_loss_gradcheck():
    g = torch.Generator().manual_seed(3)
    B, T = 3, 5
    logp = (0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros(B, T, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ent = torch.rand(B, T, generator=g, dtype=torch.float64).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    # Stay away from the kinks of the clip, where the loss is not differentiable.
    assert ((logp.detach().exp() - 0.8).abs().min() > 1e-3) and ((logp.detach().exp() - 1.2).abs().min() > 1e-3)

    def f(logp_, ent_):
        return policy_loss(logp_, old, adv, mask, 10, dual_clip=3.0, entropy_BT=ent_, entropy_coef=0.05)[0]

    assert torch.autograd.gradcheck(f, (logp, ent))


def test_value_loss_hand_values():
    # token 0: V=1, V_old=0.5, R=0: unclipped 1, clipped (0.7)^2 = 0.49 -> 0.5 * 1 = 0.5
    # token 1: V=0, V_old=1, R=0: unclipped 0, clipped (0.8)^2 = 0.64 -> 0.32 (clip active); token 2 masked.
    v = torch.tensor([[1.0, 0.0, 100.0]], dtype=torch.float64)
    v_old = torch.tensor([[0.5, 1.0, 0.0]], dtype=torch.float64)
    r = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = value_loss(v, v_old, r, mask, 2, clip_eps=0.2)
    assert loss.item() == pytest.approx((0.5 + 0.32) / 2)
    s = reduce_stats(stats)
    assert s["vf_clipfrac"] == pytest.approx(0.5)
    assert s["vf_loss"] == pytest.approx(0.41)
    assert s["value"] == pytest.approx(0.5)
    assert s["value_error_max"] == pytest.approx(1.0)
    unclipped, _ = value_loss(v, v_old, r, mask, 2, clip_eps=None)
    assert unclipped.item() == pytest.approx((0.5 + 0.0) / 2)


def test_value_loss_gradcheck_and_mask():
    g = torch.Generator().manual_seed(4)
    v = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    v_old = v.detach() + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)
    r = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 0]])
    assert torch.autograd.gradcheck(lambda v_: value_loss(v_, v_old, r, mask, 8, clip_eps=0.2)[0], (v,))
    loss, _ = value_loss(v, v_old, r, mask, 8)
    loss.backward()
    assert (v.grad[mask == 0] == 0).all()


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0, 4.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    assert explained_variance(r, r, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.5), r, mask).item() == pytest.approx(0.0)
    # errors [0, 0, 0, 1]: var 0.1875; var(R) = 1.25 -> 1 - 0.15
    v = torch.tensor([[1.0, 2.0, 3.0, 3.0, -7.0]])
    assert explained_variance(v, r, mask).item() == pytest.approx(0.85)


def test_entropy_from_logits():
    assert entropy_from_logits(torch.zeros(1, 1, 4)).item() == pytest.approx(math.log(4))
    one_hot = torch.tensor([[[0.0, -float("inf"), -float("inf")]]])
    assert entropy_from_logits(one_hot).item() == 0.0
    logits = 10 * torch.randn(2, 3, 11, dtype=torch.float64)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * torch.log_softmax(logits, -1)).sum(-1))
    assert entropy_from_logits(torch.zeros(1, 1, 4, dtype=torch.bfloat16)).dtype == torch.float32


def test_global_token_count_local():
    masks = [torch.tensor([[1, 0, 1]]), torch.tensor([[True, True], [False, True]])]
    assert global_token_count(masks) == 5
    assert global_token_count(masks[0]) == 2
