"""GAE, per-token rewards and masked whitening: hand-computed values and properties."""

import math

import pytest
import torch

from aligner.rl import gae, last_token_index, masked_global_mean_var, masked_whiten, per_token_rewards


def _gae_reference(values, rewards, gamma, lam):
    """Textbook GAE on one bare response (python floats); value after the last token is 0."""
    adv, next_v, next_a = [0.0] * len(values), 0.0, 0.0
    for t in reversed(range(len(values))):
        next_a = rewards[t] + gamma * next_v - values[t] + gamma * lam * next_a
        adv[t], next_v = next_a, values[t]
    return adv


def test_gae_nemo_aligner_values():
    values = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    adv, ret = gae(values, rewards, torch.ones(1, 4), gamma=0.5, lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5, -3.0]]))
    torch.testing.assert_close(ret, adv + values)


def test_gae_hand_value_with_lambda():
    # delta_1 = 1 + 0 - 2 = -1; delta_0 = 0 + 0.9 * 2 - 1 = 0.8; A_0 = 0.8 + 0.9 * 0.8 * (-1) = 0.08
    adv, ret = gae(torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), gamma=0.9, lam=0.8)
    torch.testing.assert_close(adv, torch.tensor([[0.08, -1.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.08, 1.0]]))


def test_gae_ignores_prompt_and_padding():
    # Row 0: prompt at 0-1, response at 2-4, padding at 5-6 holding garbage (NaN, huge values).
    # Row 1: response cut at the length limit (runs to the last position).
    values = torch.tensor([[7.0, -3.0, 0.5, 1.0, 2.0, float("nan"), 1e9], [9.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    rewards = torch.tensor([[5.0, 5.0, 0.0, 0.1, 1.0, float("inf"), 3.0], [4.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    adv, ret = gae(values, rewards, mask, gamma=0.95, lam=0.9)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    for b in range(2):
        m = mask[b]
        expected = _gae_reference(values[b][m].tolist(), rewards[b][m].tolist(), 0.95, 0.9)
        torch.testing.assert_close(adv[b][m], torch.tensor(expected))
        torch.testing.assert_close(ret[b][m], adv[b][m] + values[b][m])


def test_gae_vectorised_matches_per_row_reference():
    g = torch.Generator().manual_seed(0)
    B, T = 6, 11
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (start, end) in enumerate([(0, 11), (3, 7), (5, 6), (2, 11), (4, 4), (1, 9)]):
        mask[b, start:end] = True
    adv, ret = gae(values, rewards, mask, gamma=0.99, lam=0.95)
    assert adv.dtype == torch.float64
    for b in range(B):
        m = mask[b]
        expected = _gae_reference(values[b][m].tolist(), rewards[b][m].tolist(), 0.99, 0.95)
        torch.testing.assert_close(adv[b][m], torch.tensor(expected, dtype=torch.float64))
    assert (adv[~mask] == 0).all()


def test_gae_lambda1_gamma1_returns_are_reward_to_go():
    g = torch.Generator().manual_seed(1)
    values = torch.randn(4, 9, generator=g, dtype=torch.float64)
    rewards = torch.randn(4, 9, generator=g, dtype=torch.float64)
    mask = torch.zeros(4, 9, dtype=torch.bool)
    mask[0, 2:6] = mask[1, :] = mask[2, 8:] = mask[3, 1:8] = True
    _, ret = gae(values, rewards, mask, gamma=1.0, lam=1.0)
    masked_rewards = torch.where(mask, rewards, 0.0)
    reward_to_go = masked_rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret[mask], reward_to_go[mask])


def test_last_token_index():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 1, 0]])
    assert last_token_index(mask).tolist() == [2, 3, 0, 2]


def test_per_token_rewards_places_score_and_kl():
    kl = torch.tensor([[9.0, 0.5, 0.2, 0.1, 9.0], [9.0, 9.0, 1.0, 2.0, 3.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])
    scores = torch.tensor([2.0, -1.0, 5.0])
    rewards = per_token_rewards(scores, kl, mask, kl_coef=0.1)
    expected = torch.tensor(
        [
            [0.0, -0.05, -0.02, -0.01 + 2.0, 0.0],  # ended: score on its EOS (position 3)
            [0.0, 0.0, -0.1, -0.2, -0.3 - 1.0],  # cut at the length limit: score on the last position
            [0.0, 0.0, 0.0, 0.0, 0.0],  # no response token: nothing
        ]
    )
    torch.testing.assert_close(rewards, expected)


def test_per_token_rewards_score_clip():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards = per_token_rewards(torch.tensor([10.0, -10.0]), torch.zeros(2, 3), mask, kl_coef=0.5, score_clip=3.0)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 3.0, 0.0], [-3.0, 0.0, 0.0]]))


def test_masked_whiten_hand_values():
    x = torch.tensor([[1.0, 100.0, 3.0, -50.0]])
    mask = torch.tensor([[1, 0, 1, 0]])
    # Over the mask: mean 2, population variance 1.
    mean, var = masked_global_mean_var(x, mask)
    assert mean.item() == pytest.approx(2.0) and var.item() == pytest.approx(1.0)
    assert masked_global_mean_var(x, mask, unbiased=True)[1].item() == pytest.approx(2.0)
    torch.testing.assert_close(masked_whiten(x, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(
        masked_whiten(x, mask, shift_mean=False), torch.tensor([[1.0, 0.0, 3.0, 0.0]]), atol=1e-6, rtol=0
    )


def test_masked_whiten_properties():
    g = torch.Generator().manual_seed(2)
    x = 3.0 + 5.0 * torch.randn(5, 13, generator=g)
    x[0, :4] = float("nan")  # garbage at masked positions must not leak
    mask = torch.rand(5, 13, generator=g) > 0.4
    mask[0, :4] = False
    w = masked_whiten(x, mask)
    assert w.dtype == x.dtype
    assert (w[~mask] == 0).all()
    vals = w[mask].double()
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert vals.var(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    kept = masked_whiten(x, mask, shift_mean=False)[mask].double()
    assert kept.mean().item() == pytest.approx(x[mask].double().mean().item(), rel=1e-5)
    assert math.isclose(kept.std(unbiased=False).item(), 1.0, rel_tol=1e-5)
