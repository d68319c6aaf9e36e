"""The row-wise decode kernels after the Triton GEMMs (aligner.generation.native.rows) under Triton's interpreter
(tests/conftest.py): the eager pieces they replace (fused.py's add_parts_norm(_q) and q, the rounding points
megatron's forward has) bit for bit where no sum is reordered, and a clear error for what they do not take."""

import pytest
import torch

from aligner.families import family

pytest.importorskip("triton")

from aligner.generation.native import fp8, rows  # noqa: E402
from aligner.generation.native.fused import make_kernels  # noqa: E402

EAGER = make_kernels(family("llama"), 1e-5, compile_=False)


def _inputs(M, H, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(M, H, generator=g)).to(dtype)
    parts = 0.5 * torch.randn(4, M, H, generator=g)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(H, generator=g)).to(dtype)
    return x, parts, w, bias


def _same(got, ref):
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.equal(g.float(), r.float()), (g.float() - r.float()).abs().max()


def _one_rounding_apart(got, ref):
    """The norm's mean of squares is summed in another order than torch's: a value on a rounding boundary may land
    one unit of its dtype apart (e4m3: one of its 3-bit mantissa's units), rarely."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    g, r = got.float(), ref.float()
    if got.dtype == torch.float32:
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)
        return
    unit = 2.0 ** -{fp8.E4M3: 3, torch.bfloat16: 7, torch.float16: 10}[got.dtype]
    assert torch.all((g - r).abs() <= unit * r.abs().clamp(min=1e-30) * 1.01 + 1e-6), (g - r).abs().max()
    assert (g != r).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("M,H", [(5, 96), (3, 256)])
def test_add_parts_norm_is_the_eager_pieces_bit_for_bit(dtype, with_bias, M, H):
    """The partials summed and rounded, the bias added and rounded, the residual added and rounded, RMSNorm times its
    weight rounded once; quantized, the e4m3 row and its scale as fp8.quantize_rows gives them. bf16 rounds by hand
    under the interpreter (its own cast truncates): without that, about half the residual's values were one unit off."""
    x, parts, w, bias = _inputs(M, H, dtype, M * H)
    b = bias if with_bias else None
    (x1, h), (x0, h0) = rows.add_parts_norm(x, parts, b, w, 1e-5), EAGER.add_parts_norm(x, parts, b, w, None)
    _same([x1], [x0])  # the residual stream: no reordered sum, bit for bit
    _one_rounding_apart(h, h0)
    (x1, h8, hs), (x0, h08, hs0) = (
        rows.add_parts_norm(x, parts, b, w, 1e-5, quantize=True),
        EAGER.add_parts_norm_q(x, parts, b, w, None),
    )
    _same([x1], [x0])
    _one_rounding_apart(h8, h08)
    torch.testing.assert_close(hs, hs0, rtol=2e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_is_fp8_quantize_rows(dtype):
    g = torch.Generator().manual_seed(0)
    m = (3 * torch.randn(6, 200, generator=g)).to(dtype)
    m[2] = 0  # an all-zero row: the scale's floor, zeros out
    got = rows.quantize_rows(m)
    _same(got, fp8.quantize_rows(m))
    assert got[0].dtype == fp8.E4M3 and got[1].shape == (6, 1)
    assert torch.all(got[0][2].float() == 0)


def test_quantize_into_leaves_the_cpu_to_its_caller_and_names_wrong_buffers():
    """quantize_into writes only where its kernel runs on the GPU (the interpreter casts to e4m3 wrongly): on the CPU
    it answers False and leaves the buffers as they were; buffers of another shape are named."""
    x = torch.randn(6, 64)
    q, s = torch.zeros(6, 64, dtype=fp8.E4M3), torch.full((6,), -1.0)
    assert rows.quantize_into(x, q, s) is False
    assert torch.all(q.float() == 0) and torch.all(s == -1)
    with pytest.raises(ValueError, match="buffers"):
        rows.quantize_into(x, q[:5], s)
    with pytest.raises(ValueError, match="buffers"):
        rows.quantize_into(x, q, s.view(6, 1))


def test_what_the_kernels_do_not_take_is_named():
    x, parts, w, _ = _inputs(4, 64, torch.bfloat16, 0)
    with pytest.raises(ValueError, match="partials"):
        rows.add_parts_norm(x, parts[:, :3], None, w, 1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        rows.quantize_rows(x.t())
    with pytest.raises(ValueError, match="contiguous rows"):
        rows.quantize_rows(torch.zeros(2, rows.MAX_WIDTH + 1))
