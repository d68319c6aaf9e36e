"""SFT NLL, Bradley-Terry and DPO (sigmoid, label smoothing, IPO): hand-computed values and gradients."""

import math

import pytest
import torch

from aligner.rl import bradley_terry_loss, dpo_loss, nll_loss, reduce_stats, sequence_logprobs


def sig(x):
    return 1.0 / (1.0 + math.exp(-x))


def leaf(values):
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def test_nll_counts_only_masked_targets_over_the_global_count():
    logp = leaf([[-1.0, -2.0, -3.0], [-0.5, float("-inf"), -4.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    loss, stats = nll_loss(logp, mask, num_tokens_global=4)  # another micro-batch holds the 4th token
    assert loss.item() == pytest.approx((2.0 + 3.0 + 0.5) / 4)
    loss.backward()
    # -1/N on each masked target, exactly 0 elsewhere (also where the log-prob is -inf)
    torch.testing.assert_close(logp.grad, -mask.double() / 4)
    r = reduce_stats(stats)
    assert r["tokens"] == 3 and r["nll"] == pytest.approx(5.5 / 3)


def test_sequence_logprobs_sum_and_mean():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(sequence_logprobs(logp, mask), torch.tensor([-5.0, -4.0]))
    torch.testing.assert_close(sequence_logprobs(logp, mask, average=True), torch.tensor([-2.5, -4.0]))


def test_bradley_terry_hand_values_and_gradients():
    chosen, rejected = leaf([2.0, 0.0]), leaf([1.0, 1.0])
    loss, stats = bradley_terry_loss(chosen, rejected, num_pairs_global=2)
    # -log sigmoid(1) = log(1 + e^-1); -log sigmoid(-1) = log(1 + e)
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.e)) / 2, rel=1e-6)
    loss.backward()
    expected = torch.tensor([-sig(-1.0) / 2, -sig(1.0) / 2], dtype=torch.float64)
    torch.testing.assert_close(chosen.grad, expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rejected.grad, -expected, rtol=1e-6, atol=1e-7)
    r = reduce_stats(stats, count="pairs")
    assert r["pairs"] == 2
    assert r["accuracy"] == 0.5
    assert r["margin"] == pytest.approx(0.0)
    assert r["chosen"] == pytest.approx(1.0) and r["rejected"] == pytest.approx(1.0)


def test_bradley_terry_is_blind_to_a_shared_offset():
    a, _ = bradley_terry_loss(torch.tensor([0.3, -1.0]), torch.tensor([0.1, 2.0]), 2)
    b, _ = bradley_terry_loss(torch.tensor([5.3, 4.0]), torch.tensor([5.1, 7.0]), 2)
    assert a.item() == pytest.approx(b.item(), rel=1e-6)


def _dpo(beta, label_smoothing=0.0, loss_type="sigmoid"):
    # h = (pi_c - ref_c) - (pi_r - ref_r) = (-1 + 2) - (-3 + 2) = 2
    pc, pr = leaf([-1.0]), leaf([-3.0])
    rc, rr = leaf([-2.0]), leaf([-2.0])
    loss, stats = dpo_loss(pc, pr, rc, rr, 1, beta=beta, label_smoothing=label_smoothing, loss_type=loss_type)
    loss.backward()
    return loss.item(), pc.grad.item(), pr.grad.item(), rc.grad, reduce_stats(stats, count="pairs")


def test_dpo_sigmoid_hand_values_and_gradients():
    loss, g_chosen, g_rejected, ref_grad, r = _dpo(beta=0.5)
    assert loss == pytest.approx(-math.log(sig(1.0)), rel=1e-6)  # beta * h = 1
    assert g_chosen == pytest.approx(-0.5 * sig(-1.0), rel=1e-6)
    assert g_rejected == pytest.approx(0.5 * sig(-1.0), rel=1e-6)
    assert ref_grad is None, "the reference carries no gradient"
    assert r["chosen"] == pytest.approx(0.5) and r["rejected"] == pytest.approx(-0.5)
    assert r["margin"] == pytest.approx(1.0) and r["accuracy"] == 1.0


def test_dpo_label_smoothing_hand_values_and_gradients():
    loss, g_chosen, g_rejected, _, _ = _dpo(beta=0.5, label_smoothing=0.1)
    assert loss == pytest.approx(-0.9 * math.log(sig(1.0)) - 0.1 * math.log(sig(-1.0)), rel=1e-6)
    expected = 0.5 * (-0.9 * sig(-1.0) + 0.1 * sig(1.0))
    assert g_chosen == pytest.approx(expected, rel=1e-6) and g_rejected == pytest.approx(-expected, rel=1e-6)


def test_ipo_hand_values_and_gradients():
    loss, g_chosen, g_rejected, _, _ = _dpo(beta=0.5, loss_type="ipo")
    assert loss == pytest.approx((2.0 - 1.0) ** 2)  # 1 / (2 beta) = 1
    assert g_chosen == pytest.approx(2.0) and g_rejected == pytest.approx(-2.0)


def test_dpo_at_the_reference_is_log2_with_no_win():
    same = torch.tensor([-3.0, -7.0])
    loss, stats = dpo_loss(same, same, same, same, 2, beta=0.1)
    assert loss.item() == pytest.approx(math.log(2.0))
    r = reduce_stats(stats, count="pairs")
    assert r["accuracy"] == 0.0 and r["margin"] == 0.0


@pytest.mark.parametrize(
    "kwargs, text",
    [({"beta": 0.0}, "beta"), ({"label_smoothing": 0.5}, "label_smoothing"), ({"loss_type": "hinge"}, "loss_type")],
)
def test_dpo_rejects_bad_settings(kwargs, text):
    x = torch.zeros(1)
    with pytest.raises(ValueError, match=text):
        dpo_loss(x, x, x, x, 1, **kwargs)
