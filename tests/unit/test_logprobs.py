import math

import pytest
import torch

from aligner.models import logprobs
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


@pytest.mark.parametrize("chunk_elements", [16 * 3, 16 * 5 * 2])  # positions split inside a sample; whole samples
def test_chunks_change_nothing(chunk_elements):
    """Any chunking gives the one-chunk answer, forward and backward, on the shifted (non-contiguous) logits that
    the losses pass, with temperature, padding and both outputs."""
    torch.manual_seed(1)
    full = torch.randn(3, 6, 16, dtype=torch.float64) * 3
    targets = torch.randint(0, 13, (3, 5))
    w1, w2 = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    results = []
    for chunk in (1 << 30, chunk_elements):
        x = full.clone().requires_grad_()
        logits, _ = shift_for_next_token(x, torch.zeros(3, 6, dtype=torch.long))
        assert not logits.is_contiguous()
        logp, ent = vocab_parallel_logprobs(
            logits, targets, temperature=0.7, vocab_size=13, with_entropy=True, chunk_elements=chunk
        )
        ((logp * w1).sum() + (ent * w2).sum()).backward()
        results.append((logp, ent, x.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)


def test_backward_keeps_no_float32_copy_of_the_vocabulary():
    """What autograd keeps between forward and backward: the bf16 logits themselves and per-position statistics,
    never a float32 [tokens, vocabulary] tensor; the gradient comes back in bf16."""
    B, T, V = 2, 7, 64
    logits = (torch.randn(B, T, V) * 2).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (B, T))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = vocab_parallel_logprobs(logits, targets, with_entropy=True, chunk_elements=V)
    big = [t for t in saved if t.numel() >= B * T * V]
    assert len(big) == 1 and big[0].dtype == torch.bfloat16 and big[0].data_ptr() == logits.data_ptr()
    (logp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_()
    lp = torch.log_softmax(ref, -1)
    (lp.gather(-1, targets.unsqueeze(-1)).sum() - (lp.exp() * lp).sum()).backward()
    torch.testing.assert_close(logits.grad.float(), ref.grad, rtol=2e-2, atol=4e-3)


def test_with_the_entropy_unused_by_the_loss_the_gradient_is_the_logp_one():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 10, dtype=torch.float64)
    targets = torch.randint(0, 10, (2, 4))
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    logp, _ = vocab_parallel_logprobs(a, targets, with_entropy=True)  # entropy computed, not trained
    logp.sum().backward()
    torch.log_softmax(b, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)  # computed in float32


@pytest.fixture
def fusion():
    yield logprobs.set_fusion
    logprobs.set_fusion("auto")


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_compiled_chunks_match_the_eager_ones(fusion, device):
    """`model.logprob_fusion: on`: the chunk maths compiled by torch.compile (fused kernels) give the eager answer,
    forward and backward, for bf16 logits with vocabulary padding, temperature and chunks of two shapes; with both
    outputs trained and with the entropy unused."""
    torch.manual_seed(3)
    full = (torch.randn(3, 9, 40, device=device) * 4).bfloat16()
    targets = torch.randint(0, 37, (3, 8), device=device)
    w1, w2 = torch.randn(3, 8, device=device), torch.randn(3, 8, device=device)
    for with_entropy_grad in (True, False):
        results = []
        for setting in ("off", "on"):
            fusion(setting)
            assert (logprobs._kernels(torch.device(device)) is logprobs._EAGER) == (setting == "off")
            x = full.clone().requires_grad_()
            logits, _ = shift_for_next_token(x, targets)
            logp, ent = vocab_parallel_logprobs(
                logits, targets, temperature=0.7, vocab_size=37, with_entropy=True, chunk_elements=40 * 5
            )
            loss = (logp * w1).sum() + ((ent * w2).sum() if with_entropy_grad else 0.0)
            loss.backward()
            results.append((logp, ent, x.grad))
        (logp_e, ent_e, grad_e), (logp_c, ent_c, grad_c) = results
        torch.testing.assert_close(logp_c, logp_e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ent_c, ent_e, rtol=1e-5, atol=1e-5)
        assert grad_c.dtype == torch.bfloat16 and torch.all(grad_c[..., 37:] == 0)
        torch.testing.assert_close(grad_c.float(), grad_e.float(), rtol=1.6e-2, atol=1e-5)  # one bf16 rounding


def test_scoring_and_update_passes_run_the_same_compiled_kernels(fusion):
    """KL 0 at step 0 needs equal logits to give equal log-probs in a no-grad scoring pass and in the update's
    forward. Both must run the same compiled kernels: a variant compiled for logits that require grad (dynamic
    shapes, other reduction splits) gave a GRPO step-0 KL of -3.6e-12 on the GPU."""
    from torch._dynamo.utils import counters

    fusion("on")
    torch._dynamo.reset()
    torch.manual_seed(4)
    V = 300
    logits = (torch.randn(7, 11, V) * 3).bfloat16()  # chunks of 3, 3 and 1 samples: two shapes, as in a real pass
    targets = torch.randint(0, V, (7, 11))
    with torch.no_grad():
        scored = vocab_parallel_logprobs(logits, targets, chunk_elements=V * 11 * 3)
    graphs = counters["stats"]["unique_graphs"]
    trained = vocab_parallel_logprobs(logits.clone().requires_grad_(), targets, chunk_elements=V * 11 * 3)
    assert counters["stats"]["unique_graphs"] == graphs, "the update's forward compiled kernels of its own"
    assert torch.equal(trained, scored)


def test_fusion_setting_is_checked():
    with pytest.raises(ValueError, match="auto, on or off"):
        logprobs.set_fusion("yes")


def test_a_failed_compile_falls_back_to_the_eager_maths(fusion, monkeypatch, caplog):
    """The fused kernels are accelerators: where torch.compile cannot build them (here for real: inductor without a
    working C++ compiler, caches off) the log-probs run eagerly after one warning naming the setting."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(logprobs, "_compiled", None)
    torch._dynamo.reset()
    torch.manual_seed(5)
    logits = (torch.randn(2, 5, 30) * 3).bfloat16().requires_grad_()
    targets = torch.randint(0, 30, (2, 5))
    fusion("off")
    eager = vocab_parallel_logprobs(logits, targets)
    fusion("on")
    # torch's own config patch (restored on exit): no working C++ compiler, nothing from the caches
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/g++",), "fx_graph_cache": False}):
        with caplog.at_level("WARNING"):
            fallback = vocab_parallel_logprobs(logits, targets)
            fallback.sum().backward()
    assert torch.equal(fallback, eager)
    warnings = [r.getMessage() for r in caplog.records if "model.logprob_fusion" in r.getMessage()]
    assert warnings and "InvalidCxxCompiler" in warnings[0] and "eagerly" in warnings[0], warnings
    assert all(k.failure for k in logprobs._compiled[:2]), "the forward's kernels are marked failed"
    torch._dynamo.reset()
