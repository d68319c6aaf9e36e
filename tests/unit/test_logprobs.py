import math

import pytest
import torch

from aligner.models.logprobs import shift_for_next_token, vocab_parallel_logprobs


def _reference(logits, targets, temperature, vocab_size):
    logits = logits[..., :vocab_size].double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_log_softmax_values_and_grads(temperature):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 16, dtype=torch.float64) * 3
    targets = torch.randint(0, 13, (3, 5))
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    logp, ent = vocab_parallel_logprobs(a, targets, temperature=temperature, vocab_size=13, with_entropy=True)
    ref_logp, ref_ent = _reference(b, targets, temperature, 13)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-6, atol=1e-6)
    w1, w2 = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    ((logp * w1).sum() + (ent * w2).sum()).backward()
    ((ref_logp * w1).sum() + (ref_ent * w2).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert torch.all(a.grad[..., 13:] == 0), "vocabulary padding must get no gradient"


def test_uniform_entropy_is_log4():
    _, ent = vocab_parallel_logprobs(torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.long), with_entropy=True)
    assert ent.item() == pytest.approx(math.log(4), abs=1e-6)  # 2 bits


def test_padding_never_carries_probability():
    logits = torch.zeros(1, 1, 8)
    logits[..., 6:] = 100.0  # huge logits on padding columns must not matter
    logp = vocab_parallel_logprobs(logits, torch.tensor([[0]]), vocab_size=6)
    assert logp.item() == pytest.approx(-math.log(6), abs=1e-6)


def test_shift_alignment():
    logits = torch.arange(12.0).view(1, 4, 3)
    tokens = torch.tensor([[5, 6, 7, 8]])
    lg, tg = shift_for_next_token(logits, tokens)
    assert lg.shape == (1, 3, 3) and tg.tolist() == [[6, 7, 8]]
    assert torch.equal(lg[0, 0], logits[0, 0])
