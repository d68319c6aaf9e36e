"""`model.rope_fusion`: aligner's fused RoPE (aligner.models.rope_fusion) in megatron's fused-RoPE seam computes what
megatron's unfused RoPE computes, forward and backward, in a real megatron GPTModel: the Triton kernel (the GPU's
path; Triton's interpreter here) and the torch.compile form (inductor's C++ kernels here)."""

import logging
import shutil

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from aligner.models import rope_fusion as rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [8, 4])
def test_the_formula_is_megatrons_unfused_rope(dtype, rot):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=g).to(dtype)
    freqs = torch.randn(6, 1, 1, rot, generator=g) * 5
    assert torch.equal(rope.rope_bshd(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs))


def _megatrons(t, freqs, grad):
    t = t.detach().requires_grad_()
    out = _apply_rotary_pos_emb_bshd(t, freqs)
    return out.detach(), torch.autograd.grad(out, t, grad)[0]


def _kernels(t, freqs, grad):
    t = t.detach().requires_grad_()
    out = rope.rope_kernel(t, freqs)
    assert out.is_contiguous() and out.dtype == t.dtype
    return out.detach(), torch.autograd.grad(out, t, grad)[0]


@pytest.mark.parametrize(
    "shape, rot, per_sample",
    [((7, 2, 3, 8), 8, False), ((7, 2, 3, 8), 4, False), ((5, 3, 20, 6), 6, True), ((4, 1, 2, 32), 16, False)],
)
def test_the_kernel_is_megatrons_unfused_rope_forward_and_backward(shape, rot, per_sample):
    """Rotary part narrower than the head (rotary_percent < 1), frequencies per sample, more heads than one program
    holds at a 6-wide head, a head of 32 with 16 rotated: float32 equal to rounding, gradients too."""
    g = torch.Generator().manual_seed(sum(shape) + rot)
    s, b, h, d = shape
    t = torch.randn(shape, generator=g)
    freqs = torch.randn(s, b if per_sample else 1, 1, rot, generator=g) * 40  # angles far past 2 pi
    grad = torch.randn(shape, generator=g)
    (out, dt), (ref, dref) = _kernels(t, freqs, grad), _megatrons(t, freqs, grad)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dt, dref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(out[..., :rot], t[..., :rot]) and torch.equal(out[..., rot:], t[..., rot:])
    assert not torch.equal(dt[..., :rot], grad[..., :rot]) and torch.equal(dt[..., rot:], grad[..., rot:])


def test_the_kernel_takes_any_strides_and_bf16():
    """A view into a wider tensor (the query's slice of a fused projection) and its transposed-batch form give what
    the contiguous copy gives; bf16 within a few roundings of megatron's bf16 (which rounds after each operation)."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 2, 5, 16, generator=g)
    t = wide[:, :, 1:4, 4:12]  # strides of the wide tensor, the last one 1
    freqs = torch.randn(6, 1, 1, 8, generator=g) * 10
    grad = torch.randn(6, 2, 3, 8, generator=g)
    assert not t.is_contiguous()
    ref, dref = _kernels(t.contiguous(), freqs, grad)
    for view in (t, t.transpose(0, 1).contiguous().transpose(0, 1)):
        out, dt = _kernels(view, freqs, grad)
        assert torch.equal(out, ref) and torch.equal(dt, dref)
    (out, dt), (ref, dref) = (f(t.bfloat16(), freqs, grad.bfloat16()) for f in (_kernels, _megatrons))
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-6, atol=2**-6)  # a few of bf16's roundings
    torch.testing.assert_close(dt.float(), dref.float(), rtol=2**-6, atol=2**-6)


def test_the_kernel_rounds_cos_and_sin_to_the_tensors_dtype_as_megatron_does():
    """bf16: the kernel's result is the float32 rotation by cos and sin rounded to bf16 (megatron's, HF's and the
    engine's rounding), rounded once; with cos and sin unrounded many results differ. Under the interpreter, whose
    casts to bf16 truncate, the same with truncation."""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(64, 1, 2, 16, generator=g).bfloat16()
    freqs = torch.rand(64, 1, 1, 16, generator=g) * 64

    def bf16(v):  # the interpreter's cast: truncation of the float32 bits
        return (v.float().view(torch.int32) & -65536).view(torch.float32)

    def rotated(round_cos_sin: bool):
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if round_cos_sin:
            cos, sin = bf16(cos), bf16(sin)
        x = t.float()
        x1, x2 = x.chunk(2, dim=-1)
        return bf16(x * cos + torch.cat((-x2, x1), dim=-1) * sin)

    out = rope.rope_kernel(t, freqs).float()
    assert (out == rotated(True)).float().mean() > 0.97  # the rest: float32 rounding of the sums (fma or not)
    assert (out == rotated(False)).float().mean() < 0.9


def test_a_kernel_failure_leaves_the_compiled_form(monkeypatch, caplog):
    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")

    def broken(t, freqs):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(rope, "_kernel_failure", None)
    monkeypatch.setattr(rope, "rope_kernel", broken)
    t, freqs = torch.randn(5, 1, 2, 8), torch.randn(5, 1, 1, 8)
    with caplog.at_level(logging.WARNING, logger=rope.__name__):
        out = rope.fused_rope(t, freqs)
    assert "no kernel image" in rope._kernel_failure and "compiled form runs from now on" in caplog.text
    torch.testing.assert_close(out, _apply_rotary_pos_emb_bshd(t, freqs))
    assert not rope._kernel_takes(t, freqs)


@pytest.mark.parametrize("path", ["kernel", "compiled"])
def test_a_model_with_fused_rope_matches_the_unfused_one(path, monkeypatch):
    from critic_harness import init_single_process, tiny_model

    from aligner.models.gpt import build_gpt, forward

    if path == "compiled":
        if not (shutil.which("g++") or shutil.which("c++")):
            pytest.skip("torch.compile on CPU needs a C++ compiler")
        monkeypatch.setattr(rope, "_kernel_takes", lambda t, freqs: False)
    calls = []
    monkeypatch.setattr(rope, "rope_kernel", lambda t, freqs, real=rope.rope_kernel: calls.append(1) or real(t, freqs))
    init_single_process()
    plain = build_gpt(tiny_model(rope_fusion="off"))
    fused = build_gpt(tiny_model(rope_fusion="on"))
    fused.load_state_dict(plain.state_dict())
    assert fused.config.apply_rope_fusion and not plain.config.apply_rope_fusion
    from megatron.core.models.common.embeddings import rope_utils

    assert rope.install() == "aligner" and rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope
    for length in (9, 12):  # a second length: the compiled kernel takes new shapes
        tokens = torch.randint(0, 48, (2, length), generator=torch.Generator().manual_seed(length))
        outs = []
        for model in (plain, fused):
            model.zero_grad()
            logits = forward(model, tokens)
            logits.float().square().mean().backward()
            outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (a, ga), (b, gb) = outs
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for name, grad in ga.items():
            torch.testing.assert_close(gb[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert (len(calls) > 0) == (path == "kernel") and (path == "kernel" or rope._compiled is not None)


def test_auto_is_on_only_on_a_gpu_with_triton():
    assert not rope.wanted("auto", rope=True, interleaved=False, gpu=False)
    assert not rope.wanted("on", rope=False, interleaved=False, gpu=True)  # learned positions (GPT-2)
    assert not rope.wanted("off", rope=True, interleaved=False, gpu=True)
    assert rope.wanted("on", rope=True, interleaved=False, gpu=False)
