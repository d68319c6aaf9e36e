"""Advantage estimators (aligner.rl.estimators) on one group of 4 samples with known rewards, by hand; the KL as a
reward penalty against the KL as a loss term; DAPO's soft overlong penalty; constant groups."""

import math

import pytest
import torch

from aligner.rl import constant_groups, make_estimator, overlong_penalty, policy_loss, returns_to_go

# One prompt, 4 samples: scores 0, 1, 1, 2 (mean 1, sample std sqrt(2/3)).
SCORES = torch.tensor([0.0, 1.0, 1.0, 2.0])
# Response tokens of each sample on a grid of T = 5 (prompt/padding elsewhere): lengths 2, 3, 1, 3.
MASK = torch.tensor(
    [
        [0, 1, 1, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 1],
    ],
    dtype=torch.float32,
)
NO_KL = torch.zeros(4, 5)


def per_token(values, mask=MASK):
    """[4] -> [4, 5]: each sample's value on its response tokens."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1) * mask


def test_grpo_group_of_four():
    adv, ret = make_estimator("grpo", 4)(SCORES, NO_KL, MASK, kl_coef=0.0)
    std = math.sqrt(2 / 3)
    torch.testing.assert_close(adv, per_token([-1 / (std + 1e-6), 0.0, 0.0, 1 / (std + 1e-6)]))
    torch.testing.assert_close(ret, adv)
    adv, _ = make_estimator("grpo", 4, normalize_std=False)(SCORES, NO_KL, MASK, kl_coef=0.0)
    torch.testing.assert_close(adv, per_token([-1.0, 0.0, 0.0, 1.0]))


def test_rloo_group_of_four():
    # Leave-one-out baselines: (4 - s_i) / 3 = 4/3, 1, 1, 2/3.
    adv, _ = make_estimator("rloo", 4)(SCORES, NO_KL, MASK, kl_coef=0.0)
    torch.testing.assert_close(adv, per_token([-4 / 3, 0.0, 0.0, 4 / 3]))


def test_reinforce_pp_group_of_four():
    # No KL: the return of every token is its sample's score; whitened over the 9 response tokens:
    # mean 10/9, population variance (2 (10/9)^2 + 4 (1/9)^2 + 3 (8/9)^2) / 9 = 396/729.
    adv, ret = make_estimator("reinforce_pp", 4)(SCORES, NO_KL, MASK, kl_coef=0.0)
    torch.testing.assert_close(ret, per_token([0.0, 1.0, 1.0, 2.0]))
    std = math.sqrt(396 / 729 + 1e-8)
    torch.testing.assert_close(adv, per_token([(s - 10 / 9) / std for s in (0.0, 1.0, 1.0, 2.0)]))


def test_gae_group_of_four():
    # lambda = gamma = 1, a constant value of 0.5 and no KL: A_t = score - 0.5, returns = score on every token.
    est = make_estimator("gae", 4, gamma=1.0, lam=1.0, whiten=False)
    assert est.uses_values
    adv, ret = est(SCORES, NO_KL, MASK, kl_coef=0.0, values_BT=0.5 * MASK)
    torch.testing.assert_close(adv, per_token([-0.5, 0.5, 0.5, 1.5]))
    torch.testing.assert_close(ret, per_token([0.0, 1.0, 1.0, 2.0]))
    with pytest.raises(ValueError, match="values"):
        est(SCORES, NO_KL, MASK, kl_coef=0.0)


def test_kl_in_the_reward_is_paid_on_every_later_token():
    # KL of 1 on every token, coefficient 0.1, gamma 1: a token's advantage is the shaped score minus 0.1 times the
    # number of response tokens from it to the end of its response.
    kl = torch.ones(4, 5)
    adv, _ = make_estimator("grpo", 4, normalize_std=False)(SCORES, kl, MASK, kl_coef=0.1)
    expected = torch.tensor(
        [
            [0.0, -1.2, -1.1, 0.0, 0.0],
            [-0.3, -0.2, -0.1, 0.0, 0.0],
            [0.0, 0.0, -0.1, 0.0, 0.0],
            [0.0, 0.0, 0.7, 0.8, 0.9],
        ]
    )
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize(
    "estimator, grad_of_kl",
    [
        ("k1", lambda d: torch.ones_like(d)),
        ("k2", lambda d: d),
        ("k3", lambda d: 1 - torch.exp(-d)),
    ],
)
def test_kl_as_a_loss_term_adds_its_gradient(estimator, grad_of_kl):
    """On-policy (ratio 1, nothing clipped) the policy loss is mean(-A) + beta * mean(kl), and d loss / d logp is
    (-A + beta * d kl / d logp) / N per token: the reference pulls each token's log-prob back by the estimator's
    slope, while the advantages carry no KL."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    delta = torch.tensor([[0.3, -0.2, 0.0]], dtype=torch.float64)  # logp - ref_logp
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    beta = 0.5
    loss, stats = policy_loss(
        logp, logp.detach(), adv, mask, 3, ref_logp_BT=logp.detach() - delta, kl_coef=beta, kl_estimator=estimator
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, (-adv + beta * grad_of_kl(delta)) / 3)
    kl = {"k1": delta, "k2": 0.5 * delta**2, "k3": torch.exp(-delta) - 1 + delta}[estimator]
    torch.testing.assert_close(loss.detach(), (-adv.sum() + beta * kl.sum()) / 3)
    torch.testing.assert_close(stats["kl_loss_sum"], kl.sum())
    # Without the term (kl_coef = 0) the gradient is the surrogate's alone; the KL is still reported.
    logp.grad = None
    loss, stats = policy_loss(
        logp, logp.detach(), adv, mask, 3, ref_logp_BT=logp.detach() - delta, kl_estimator=estimator
    )
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3)
    torch.testing.assert_close(stats["kl_loss_sum"], kl.sum())


def test_returns_to_go_discounts():
    rewards = torch.tensor([[5.0, 1.0, 2.0, 4.0, 9.0]])
    mask = torch.tensor([[0, 1, 1, 1, 0]])
    torch.testing.assert_close(returns_to_go(rewards, mask, 0.5), torch.tensor([[0.0, 3.0, 4.0, 4.0, 0.0]]))


def test_overlong_penalty_hand_values():
    lengths = torch.tensor([5, 6, 7, 8, 10])
    # max 10, buffer 4: free up to 6 tokens, then -factor/4 per token.
    torch.testing.assert_close(overlong_penalty(lengths, 10, 4, 0.5), torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 10, 11)


def test_constant_groups():
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert constant_groups(scores, 4).tolist() == [True, False]


def test_group_estimators_need_groups():
    with pytest.raises(ValueError, match="samples per prompt"):
        make_estimator("grpo", 1)
    with pytest.raises(ValueError, match="one of"):
        make_estimator("ppo", 4)
