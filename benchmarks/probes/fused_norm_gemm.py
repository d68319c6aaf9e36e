"""Probe (issue 17, nineteenth session; a recorded negative result): a decode layer's residual-add + RMSNorm kernels
folded into the GEMMs around them, at decode batch sizes on one GPU.

The engine's layer at B <= 128 (docs/PERF.md): add_parts_norm -> qkv (cuBLAS) -> attention -> proj (split-K,
float32 partials) -> add_parts_norm -> fc1 + SwiGLU (gated kernel) -> fc2 (split-K). The probed form drops both
add+norm kernels: qkv and fc1 read the residual stream itself and apply the norm on the way (squares summed in the K
loop, the norm weight applied to each x tile, the row scale applied to the float32 sums), and proj and fc2 run as one
K range each and add their product into the residual stream in place. It prints each new kernel's best tiling over
16 layers' distinct weights, the engine's kernels alone, and the two chains of 16 layers (without attention) in one
CUDA graph, us per layer; also each kernel's largest error against float32 maths.

    python3 benchmarks/probes/fused_norm_gemm.py --batch 64 --out result.json     (CUDA; Triton)

Result on the H200 (docs/PERF.md, "Nineteenth session"): the norm in the K loop makes qkv 3.3x and fc1 1.9x slower
than the engine's kernels, and the chain twice as slow; the engine keeps its kernels.
"""

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from aligner.families import family  # noqa: E402
from aligner.generation.native import fused, pdl, splitk  # noqa: E402
from benchmarks.decode_kernels import graph_time_us  # noqa: E402
from benchmarks.ppo_step.workload import write_json  # noqa: E402

LAYERS, HIDDEN, QKV, FFN, EPS = 16, 2048, 4096, 8192, 1e-5  # the 1B model of docs/PERF.md


@triton.jit
def fused_gemm(
    x_ptr, g_ptr, w_ptr, out_ptr, M, K, F, sx_m, sw_n, so_m, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, GATED: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out = [rmsnorm(x) * g] @ W^T (NORM), silu(gate) * up of W = [Wg; Wu] (GATED), out += x @ W^T (ADD)."""
    n0 = tl.program_id(0) * BLOCK_N
    rows, cols, ks = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * sx_m + ks[None, :]
    w_tile = w_ptr + cols[:, None] * sw_n + ks[None, :]
    u_tile = w_tile + F * sw_n
    g_tile = g_ptr + ks
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ok = (rows < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_tile, mask=row_ok, other=0.0)
        if NORM:
            xf = x.to(tl.float32)
            squares += tl.sum(xf * xf, axis=1)
            x = (xf * tl.load(g_tile).to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
            g_tile += BLOCK_K
        acc = tl.dot(x, tl.trans(tl.load(w_tile)), acc)
        if GATED:
            acc_u = tl.dot(x, tl.trans(tl.load(u_tile)), acc_u)
            u_tile += BLOCK_K
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        scale = tl.rsqrt(squares / K + eps)
        acc = acc * scale[:, None]
        acc_u = acc_u * scale[:, None]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_u
    dst = out_ptr + rows[:, None] * so_m + cols[None, :]
    if ADD:
        acc = acc + tl.load(dst, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok)


def run_fused(x, w, out, tiling, g=None, gated=False, add=False):
    """One launch of fused_gemm; tiling = (block_n, block_k, stages, warps)."""
    M, K = x.shape
    block_n, block_k, stages, warps = tiling
    use_pdl = pdl.wanted(x.device, M)
    options = dict(
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, NORM=g is not None,
        GATED=gated, ADD=add, PDL=use_pdl, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if use_pdl:
        options["launch_pdl"] = True
    args = (x, x if g is None else g, w, out, M, K, out.shape[1], x.stride(0), w.stride(0), out.stride(0), EPS)
    fused_gemm[(out.shape[1] // block_n, 1, 1)](*args, **options)
    return out


def over_layers(weights, call):
    """A function whose n-th call runs `call(weights of layer n mod LAYERS)`: graph_time_us captures 16 of them."""
    counter = itertools.count()
    return lambda: call(weights[next(counter) % LAYERS])


def rms_reference(x, g):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * g.float()


def errors(B, W, X, A) -> dict:
    """Largest |error| of the new and the engine's kernels against float32 maths, layer 0's weights."""
    w, dt, dev = W[0], X.dtype, X.device
    qkv = rms_reference(X, w["gin"]) @ w["qkv"].float().t()
    gate, up = (rms_reference(X, w["gpost"]) @ w["fc1"].float().t()).split(FFN, -1)
    act = F.silu(gate) * up
    resid = X.float() + A.float() @ w["proj"].float().t()
    new_x = run_fused(A, w["proj"], X.clone(), (16, 128, 4, 4), add=True)
    parts = splitk.matmul(A, w["proj"], splitk.tiling_for(B, HIDDEN, HIDDEN))
    engine = {
        "qkv": F.linear(F.rms_norm(X, (HIDDEN,), w["gin"], EPS), w["qkv"]),
        "fc1": splitk.gated_matmul(
            F.rms_norm(X, (HIDDEN,), w["gpost"], EPS), w["fc1"], splitk.gated_tiling_for(B, 2 * FFN, HIDDEN)
        ),
        "proj_add": X + parts.sum(0).to(dt),
    }
    new = {
        "qkv": run_fused(X, w["qkv"], torch.empty(B, QKV, device=dev, dtype=dt), (64, 64, 4, 4), g=w["gin"]),
        "fc1": run_fused(X, w["fc1"], torch.empty(B, FFN, device=dev, dtype=dt), (64, 64, 4, 4), w["gpost"], True),
        "proj_add": new_x,
    }
    ref = {"qkv": qkv, "fc1": act, "proj_add": resid}
    out = {}
    for name in ref:
        out[f"err_{name}_engine"] = (engine[name].float() - ref[name]).abs().max().item()
        out[f"err_{name}_new"] = (new[name].float() - ref[name]).abs().max().item()
    return out


def best_tiling(name, weights, call, tilings, report) -> tuple:
    """The fastest of `tilings` for `call(w, tiling)`, us per call over 16 layers' weights; all times go in report."""
    times = {}
    for t in tilings:
        try:
            times[t] = round(graph_time_us(over_layers(weights, lambda w, t=t: call(w, t)), calls=16, replays=20), 2)
        except Exception as exc:  # noqa: BLE001 - a tiling that does not compile or run is reported, not fatal
            report.setdefault(f"{name}_failed", {})[str(t)] = f"{type(exc).__name__}: {str(exc)[:80]}"
    report[name] = {str(t): us for t, us in times.items()}
    best = min(times, key=times.get)
    report[f"{name}_best"] = [times[best], str(best)]
    print(name, times[best], best, flush=True)
    return best


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)
    B, dev, dt = args.batch, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)

    def rand(*shape, std=0.02):
        return torch.randn(*shape, device=dev, dtype=dt) * std

    W = [
        dict(
            qkv=rand(QKV, HIDDEN),
            proj=rand(HIDDEN, HIDDEN),
            fc1=rand(2 * FFN, HIDDEN),
            fc2=rand(HIDDEN, FFN),
            gin=1 + rand(HIDDEN, std=0.1),
            gpost=1 + rand(HIDDEN, std=0.1),
        )  # fmt: skip
        for _ in range(LAYERS)
    ]
    X, A, M_in = rand(B, HIDDEN, std=1), rand(B, HIDDEN, std=1), rand(B, FFN, std=1)
    report = {"batch": B, **errors(B, W, X, A)}
    print(json.dumps(report), flush=True)

    Q, Mb, Xw = torch.empty(B, QKV, device=dev, dtype=dt), torch.empty(B, FFN, device=dev, dtype=dt), X.clone()
    grid = [(bn, bk, st, 4) for bn in (16, 32) for bk in (64, 128, 256) for st in (3, 4, 5, 6)]
    t_qkv = best_tiling(
        "qkv_norm", W, lambda w, t: run_fused(X, w["qkv"], Q, t, g=w["gin"]),
        [(bn, bk, st, 4) for bn in (32, 64) for bk in (64, 128) for st in (3, 4, 5)], report,
    )  # fmt: skip
    t_proj = best_tiling("proj_add", W, lambda w, t: run_fused(A, w["proj"], Xw, t, add=True), grid, report)
    t_fc1 = best_tiling(
        "fc1_norm", W, lambda w, t: run_fused(X, w["fc1"], Mb, t, g=w["gpost"], gated=True),
        [(bn, bk, st, 4) for bn in (32, 64) for bk in (64, 128) for st in (4, 5)], report,
    )  # fmt: skip
    t_fc2 = best_tiling("fc2_add", W, lambda w, t: run_fused(M_in, w["fc2"], Xw, t, add=True), grid, report)

    k = fused.make_kernels(family("llama"), EPS, compile_=True, max_batch=B, pdl_device=dev)
    t_row, t_gated = splitk.tiling_for(B, HIDDEN, HIDDEN), splitk.gated_tiling_for(B, 2 * FFN, HIDDEN)
    t_fc2_engine = splitk.tiling_for(B, HIDDEN, FFN)
    parts = torch.zeros(4, B, HIDDEN, device=dev, dtype=torch.float32)
    h = F.rms_norm(X, (HIDDEN,), W[0]["gin"], EPS)
    engine_calls = {
        "qkv_cublas": lambda w: F.linear(h, w["qkv"]),
        "proj_splitk": lambda w: splitk.matmul(A, w["proj"], t_row),
        "add_parts_norm": lambda w: k.add_parts_norm(X, parts, None, w["gin"], None),
        "fc1_gated": lambda w: splitk.gated_matmul(h, w["fc1"], t_gated),
        "fc2_splitk": lambda w: splitk.matmul(M_in, w["fc2"], t_fc2_engine),
    }
    report["engine_alone"] = {
        name: round(graph_time_us(over_layers(W, call), calls=16, replays=20), 2) for name, call in engine_calls.items()
    }
    print("engine's kernels alone", report["engine_alone"], flush=True)

    def engine_chain():
        x, hidden, fc2_parts = X, h, parts
        for w in W:
            x, hidden = k.add_parts_norm(x, fc2_parts, None, w["gin"], None)
            F.linear(hidden, w["qkv"])
            x, hidden = k.add_parts_norm(x, splitk.matmul(A, w["proj"], t_row), None, w["gpost"], None)
            fc2_parts = splitk.matmul(splitk.gated_matmul(hidden, w["fc1"], t_gated), w["fc2"], t_fc2_engine)

    Xc = X.clone()

    def fused_chain():
        for w in W:
            run_fused(Xc, w["qkv"], Q, t_qkv, g=w["gin"])
            run_fused(A, w["proj"], Xc, t_proj, add=True)
            run_fused(Xc, w["fc1"], Mb, t_fc1, g=w["gpost"], gated=True)
            run_fused(Mb, w["fc2"], Xc, t_fc2, add=True)

    for _ in range(3):
        for name, chain in (("chain_engine", engine_chain), ("chain_fused", fused_chain)):
            Xc.copy_(X)
            report.setdefault(name, []).append(round(graph_time_us(chain, calls=2, replays=20) / LAYERS, 2))
    print("chains, us per layer: engine", report["chain_engine"], "fused", report["chain_fused"], flush=True)
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
