"""Probe (issue 17, thirty-seventh session): the FP8 cache's probabilities rounded to float16 for the product with V.

The decode attention kernel with an FP8 cache multiplies each probability by its slot's value scale and rounds the
product to float16, the tensor-core operand of p v (triton_decode, NATIVE_PV). The value scale is the slot's largest
|value| / 448, so for values of order 1 the products lie near or below float16's smallest normal number (6.1e-5),
where float16 keeps fewer significant bits. The thirty-sixth session saw e4m3 decoded by bit operations (scales 256x
larger) give outputs one bfloat16 step apart from the conversion path's and asked which lies closer to exact
attention, and whether a scale of 256 on the probabilities (undone once after the loop) would pay.

This answers it without a GPU: the kernel's loop (steps of --block slots, a running maximum, probabilities <= 1
relative to it) replayed in float64 except for the one rounding, with factor 1 (the kernel) and 256 (the lead), each
against the same attention over the dequantized cache in float64 (the error the rounding adds), and that attention
against attention over the values before quantization (the e4m3 cache's own error, which any FP8 cache pays). Scores
of several spreads, values of several sizes, one query row per sample; errors relative to the outputs' mean |value|.

    python3 benchmarks/probes/pv_rounding.py --out result.json
    python3 benchmarks/probes/pv_rounding.py --tiny              (what the test runs)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import write_report  # noqa: E402

E4M3, E4M3_MAX = torch.float8_e4m3fn, 448.0


def attend(scores: torch.Tensor, v8: torch.Tensor, v_scale: torch.Tensor, block: int, factor: float | None):
    """The kernel's slot loop over [N, T] scores and [N, T, D] e4m3 values (as float64) with [N, T] value scales:
    steps of `block` slots, a running maximum, each step's probabilities times the value scales (times `factor`)
    rounded to float16 for p v; factor None: not rounded. Returns [N, D]."""
    N, T = scores.shape
    m = torch.full((N,), float("-inf"), dtype=torch.float64)
    l_ = torch.zeros(N, dtype=torch.float64)
    acc = torch.zeros(N, v8.shape[-1], dtype=torch.float64)
    for lo in range(0, T, block):
        s = scores[:, lo : lo + block]
        m_new = torch.maximum(m, s.amax(1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        l_ = l_ * alpha + p.sum(1)
        p_v = p * v_scale[:, lo : lo + block]
        if factor is not None:
            p_v = (p_v * factor).to(torch.float16).double() / factor
        acc = acc * alpha[:, None] + torch.einsum("nt,ntd->nd", p_v, v8[:, lo : lo + block])
        m = m_new
    return acc / l_[:, None]


def case(n: int, slots: int, dim: int, score_std: float, value_std: float, block: int, seed: int) -> dict:
    """One spread of scores and size of values: mean and largest errors, relative to the outputs' mean |value|."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(n, slots, generator=g, dtype=torch.float64) * score_std
    values = torch.randn(n, slots, dim, generator=g, dtype=torch.float64) * value_std
    v_scale = values.abs().amax(-1) / E4M3_MAX  # quantize_fp8's rule: a scale per slot
    v8 = (values / v_scale[..., None]).float().to(E4M3).double()
    exact = attend(scores, v8, v_scale, block, None)
    size = exact.abs().mean().item()
    row = {"score_std": score_std, "value_std": value_std}
    for name, factor in (("x1", 1.0), ("x256", 256.0)):
        err = (attend(scores, v8, v_scale, block, factor) - exact).abs()
        row[f"rounding_{name}_mean"], row[f"rounding_{name}_max"] = err.mean().item() / size, err.max().item() / size
    plain = attend(scores, values, torch.ones_like(v_scale), block, None)
    err = (exact - plain).abs()
    row["e4m3_mean"], row["e4m3_max"] = err.mean().item() / size, err.max().item() / size
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--slots", type=int, default=384)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--tiny", action="store_true", help="few samples and slots (the test's size)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args(argv)
    n, slots = (64, 128) if args.tiny else (args.samples, args.slots)
    rows = [
        case(n, slots, 128, score_std, value_std, args.block, seed)
        for seed, (score_std, value_std) in enumerate(
            (s, v) for s in (1.0, 3.0, 10.0) for v in (0.05, 1.0, 5.0)
        )
    ]  # fmt: skip
    print("relative to the outputs' mean |value|: mean / max error")
    print(f"{'scores':>7} {'values':>7} {'fp16 x1':>21} {'fp16 x256':>21} {'e4m3 cache itself':>21}")
    for r in rows:
        errors = " ".join(
            f"{r[f'{k}_{s}']:10.2e}" for k in ("rounding_x1", "rounding_x256", "e4m3") for s in ("mean", "max")
        )
        print(f"{r['score_std']:7.2f} {r['value_std']:7.2f} {errors}")
    return write_report({"samples": n, "slots": slots, "block": args.block, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
