"""Critic-free baselines: GRPO, RLOO, REINFORCE++."""

import pytest
import torch

from aligner.rl import grpo_advantages, reinforce_pp_advantages, rloo_advantages, sample_to_tokens


def test_grpo_hand_values():
    scores = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    # group 0: mean 2, sample std 1 ; group 1: identical scores -> 0 (eps keeps 0 / 0 away)
    adv = grpo_advantages(scores, group_size=3)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (1 + 1e-6))
    assert (adv[3:] == 0).all()
    torch.testing.assert_close(
        grpo_advantages(scores, group_size=3, normalize_std=False), torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    )
    torch.testing.assert_close(
        grpo_advantages(torch.tensor([0.0, 4.0]), 2, eps=0.0), torch.tensor([-2.0, 2.0]) / (8.0**0.5)
    )


def test_rloo_hand_values():
    # Baselines: (2 + 6) / 2 = 4, (1 + 6) / 2 = 3.5, (1 + 2) / 2 = 1.5 ; second group: 10 - 0, 0 - 10.
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0, 4.0]), group_size=3)
    torch.testing.assert_close(adv, torch.tensor([-3.0, -1.5, 4.5, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(rloo_advantages(torch.tensor([10.0, 0.0]), 2), torch.tensor([10.0, -10.0]))


def test_group_checks():
    with pytest.raises(ValueError, match="multiple"):
        rloo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.zeros(4), 1)


def test_sample_to_tokens():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    torch.testing.assert_close(
        sample_to_tokens(torch.tensor([2.0, -1.0]), mask), torch.tensor([[0.0, 2.0, 2.0], [-1.0, -1.0, 0.0]])
    )


def test_reinforce_pp_returns_and_whitening():
    rewards = torch.tensor([[9.0, 1.0, 0.0, 2.0, 9.0], [0.0, 0.0, 0.0, 3.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 0, 1, 1]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: [1 + 0 + 0.25 * 2, 0 + 0.5 * 2, 2] ; row 1: [3 + 0.5 * 1, 1]
    expected = torch.tensor([[0.0, 1.5, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 3.5, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(ret, expected)
    vals = ret[mask.bool()]
    torch.testing.assert_close(adv[mask.bool()], (vals - vals.mean()) / (vals.var(unbiased=False) + 1e-8).sqrt())
    assert (adv[~mask.bool()] == 0).all()
