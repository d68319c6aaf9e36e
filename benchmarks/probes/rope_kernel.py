"""Probe (issue 17, forty-first session): the Triton RoPE kernel against the torch.compile form it replaced, and
against megatron's unfused form: results and time a call.

A host-bound SFT step spent ~16 % of its host time in the compiled RoPE's call path (dynamo's guards, AOT autograd's
wrappers; docs/PERF.md, thirty-ninth session). For one layer's two calls (queries [s, 1, 16, 128] and keys
[s, 1, 8, 128] of the 1B shape, bf16, megatron's frequencies for positions 0..s-1) each form runs forward and
backward `--calls` times back to back without a sync (wall us a call: the host's cost where it exceeds the GPU's)
and once more for its results: each form's mean and max |error| against the exact rotation in float64 of the same
bf16 inputs, and how many outputs and gradients the kernel and the compiled form give bit for bit the same.

    python3 benchmarks/probes/rope_kernel.py [--seq 4096] [--calls 300] [--out FILE]
    TRITON_INTERPRET=1 python3 benchmarks/probes/rope_kernel.py --tiny     (CPU: the probe itself)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.probes.common import write_report  # noqa: E402


def frequencies(seq: int, dim: int, base: float, device) -> torch.Tensor:
    """megatron's RotaryEmbedding output for positions 0..seq-1: [seq, 1, 1, dim] float32."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def exact(t: torch.Tensor, freqs: torch.Tensor, grad: torch.Tensor):
    """The rotation and its input gradient in float64 (cos and sin unrounded)."""
    t64 = t.double().detach().requires_grad_()
    f = freqs.double()
    x1, x2 = t64.chunk(2, dim=-1)
    out = t64 * torch.cos(f) + torch.cat((-x2, x1), dim=-1) * torch.sin(f)
    return out.detach(), torch.autograd.grad(out, t64, grad.double())[0]


def forms():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from aligner.models import rope_fusion
    from aligner.models.compiled import CompiledOrEager

    compiled = CompiledOrEager(rope_fusion.rope_bshd, "model.rope_fusion", dynamic=None, fullgraph=True)
    return {"kernel": rope_fusion.rope_kernel, "compiled": compiled, "megatron unfused": _apply_rotary_pos_emb_bshd}


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    shapes = [(args.seq, 1, args.heads, args.head_dim), (args.seq, 1, args.kv_heads, args.head_dim)]
    ts = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
    grads = [torch.randn(s, generator=g).to(device, dtype) for s in shapes]
    freqs = frequencies(args.seq, args.head_dim, args.base, device)
    refs = [exact(t, freqs, gr) for t, gr in zip(ts, grads)]

    def layer(fn, keep=False):
        results = []
        for t, gr in zip(ts, grads):
            x = t.detach().requires_grad_()
            out = fn(x, freqs)
            out.backward(gr)
            if keep:
                results.append((out.detach(), x.grad))
        return results

    rows, results = [], {}
    for name, fn in forms().items():
        results[name] = layer(fn, keep=True)
        for _ in range(3):
            layer(fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.calls):
            layer(fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
        us = (time.perf_counter() - start) / (2 * args.calls) * 1e6
        errs = [(o.double() - r).abs() for (o, _), (r, _) in zip(results[name], refs)]
        gerrs = [(d.double() - r).abs() for (_, d), (_, r) in zip(results[name], refs)]
        rows.append(
            {
                "form": name,
                "us_a_call": us,
                "out_err_mean": float(sum(e.sum() for e in errs) / sum(e.numel() for e in errs)),
                "out_err_max": float(max(e.max() for e in errs)),
                "grad_err_mean": float(sum(e.sum() for e in gerrs) / sum(e.numel() for e in gerrs)),
                "grad_err_max": float(max(e.max() for e in gerrs)),
            }
        )

    def same(i: int) -> float:  # the share of elements the kernel and the compiled form give equal
        pairs = list(zip(results["kernel"], results["compiled"]))
        return sum(int(torch.eq(a[i], b[i]).sum()) for a, b in pairs) / sum(a[i].numel() for a, _ in pairs)

    report = {"device": str(torch.cuda.get_device_name() if device.type == "cuda" else "cpu"), "seq": args.seq,
              "rows": rows, "kernel_equals_compiled": {"outputs": same(0), "gradients": same(1)}}  # fmt: skip
    print(f"{report['device']}: one layer's RoPE calls (q {shapes[0]}, k {shapes[1]}, bf16), forward + backward")
    print("| form | us a call | output err mean / max | gradient err mean / max |\n|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['form']} | {r['us_a_call']:.1f} | {r['out_err_mean']:.2e} / {r['out_err_max']:.2e} | "
            f"{r['grad_err_mean']:.2e} / {r['grad_err_max']:.2e} |"
        )
    eq = report["kernel_equals_compiled"]
    print(f"kernel = compiled bit for bit: outputs {eq['outputs']:.4%}, gradients {eq['gradients']:.4%}")
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--base", type=float, default=10000.0)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.heads, args.kv_heads, args.head_dim, args.calls = 16, 4, 2, 16, 2
    report = run(args)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
