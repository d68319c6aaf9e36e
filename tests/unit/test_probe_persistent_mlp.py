"""The persistent MLP kernel of benchmarks/probes/persistent_mlp.py under Triton's interpreter (tests/conftest.py):
one program (the interpreter runs programs one after another, so a grid-wide barrier can only be met by one), its
three stages against float32 maths, with and without the weight preload before its barriers, and its barrier
counters left at zero for the next launch."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from benchmarks.probes import persistent_mlp as pm  # noqa: E402

M, H, FF, S_IN = 4, 64, 128, 3


@pytest.mark.parametrize(
    "bn1, bn2, s_out, preload",
    [(16, 16, 2, 0), (128, 64, 1, 0), (128, 64, 1, 1), (128, 64, 1, 2)],
    ids=["tiles-in-a-loop", "one-tile", "one-tile-preload1", "one-tile-preload2"],
)
def test_stages_match_float32_maths(bn1, bn2, s_out, preload):
    g = torch.Generator().manual_seed(preload)
    bf = torch.bfloat16
    x = torch.randn(M, H, generator=g).to(bf)
    parts_in = torch.randn(S_IN, M, H, generator=g) * 0.25
    norm_w = (1 + 0.1 * torch.randn(H, generator=g)).to(bf)
    w1 = (0.1 * torch.randn(2 * FF, H, generator=g)).to(bf)
    w2 = (0.1 * torch.randn(H, FF, generator=g)).to(bf)
    h, act = torch.empty(M, H, dtype=bf), torch.empty(M, FF, dtype=bf)
    parts_out, bar = torch.empty(s_out, M, H), torch.zeros(2, dtype=torch.int32)
    x_k = x.clone()
    pm.persistent_mlp[(1,)](
        x_k, parts_in, norm_w, w1, w2, h, act, parts_out, bar, M, pm.EPS,
        H=H, FF=FF, S_IN=S_IN, S_OUT=s_out, PROGRAMS=1, BLOCK_M=16, BN1=bn1, BK1=16, BN2=bn2, BK2=16,
        PF1=0, PF2=0, PRELOAD=preload, WIDEN=True,
    )  # fmt: skip
    ref_x, ref_act, ref_parts = pm.reference(x, parts_in, norm_w, w1, w2, s_out)
    # the interpreter rounds to bf16 toward zero (a GPU to nearest): x + a rounds twice, a bf16 step or two apart
    step = 2.0**-7
    torch.testing.assert_close(x_k.float(), ref_x.float(), rtol=2 * step, atol=4 * step)
    xf = x_k.float()
    ref_h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + pm.EPS) * norm_w.float()
    torch.testing.assert_close(h.float(), ref_h, rtol=2 * step, atol=1e-3)
    # fc1 + SwiGLU and fc2 from the kernel's own h and act: the products themselves, in float32
    gate, up = (h.float() @ w1.float().t()).split(FF, -1)
    torch.testing.assert_close(act.float(), F.silu(gate) * up, rtol=2 * step, atol=1e-3)
    k2 = FF // s_out
    for s in range(s_out):
        own = act[:, s * k2 : (s + 1) * k2].float() @ w2[:, s * k2 : (s + 1) * k2].float().t()
        torch.testing.assert_close(parts_out[s], own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts_out.sum(0), ref_parts.sum(0), rtol=0.05, atol=0.05)
    assert bar.tolist() == [0, 0]  # both counters reset by the last program out
