"""Probe (issue 17, twentieth session): decode's weight GEMMs with the weights read by the Hopper tensor memory
accelerator (TMA) instead of per-thread pointer loads.

The engine's split-K and gated kernels (aligner/generation/native/splitk.py) read each weight tile by pointer
arithmetic: every thread computes addresses and issues its own loads (cp.async under Triton's pipeliner). At B=64
they stream 64 MiB (fc1) at ~3.5 TB/s and a few MiB well below the 4.2 TB/s copy rate (docs/PERF.md, nineteenth
session). Here the same kernels take the weight through a TMA descriptor (`triton.tools.tensor_descriptor`): one
instruction per tile, addresses computed by the copy engine. Each pair (pointer / TMA) runs with the same tiling
over 16 layers' distinct weights in one CUDA graph, PDL as the engine launches them, us per call; also a plain
streaming read of each weight both ways, and the largest difference between the two forms' results.

    python3 benchmarks/probes/tma_gemm.py --out result.json     (CUDA, sm_90; Triton)
"""

import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import parse_args, randn  # noqa: E402

LAYERS, HIDDEN, QKV, FFN = 16, 2048, 4096, 8192  # the 1B model of docs/PERF.md


@triton.jit
def tma_splitk(
    x_ptr, w_desc, out_ptr, M, K_SPLIT, sx_m, so_s, so_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """splitk.matmul's kernel (no swap) with W [N, K] read through a TMA descriptor of [BLOCK_N, BLOCK_K] blocks."""
    n0, s = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    rows, cols, ks = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    k0 = s * K_SPLIT
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ok = (rows < M)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k0 + K_SPLIT, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * sx_m + (k + ks)[None, :], mask=row_ok, other=0.0)
        w = w_desc.load([n0, k])
        acc = tl.dot(x, tl.trans(w), acc)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + s * so_s + rows[:, None] * so_m + cols[None, :], acc, mask=row_ok)


@triton.jit
def tma_gated(
    x_ptr, w_desc, out_ptr, M, K, F, sx_m, so_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """splitk.gated_matmul's kernel (no swap) with W = [Wg; Wu] read through a TMA descriptor."""
    n0 = tl.program_id(0) * BLOCK_N
    rows, cols, ks = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ok = (rows < M)[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + rows[:, None] * sx_m + (k + ks)[None, :], mask=row_ok, other=0.0)
        g = w_desc.load([n0, k])
        u = w_desc.load([F + n0, k])
        acc_g = tl.dot(x, tl.trans(g), acc_g)
        acc_u = tl.dot(x, tl.trans(u), acc_u)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def stream_rows(w_ptr, w_desc, out_ptr, K, sw_n, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TMA: tl.constexpr):
    """Sum a [BLOCK_N, K] slab of W per program, read by pointers or by TMA: the read rate alone."""
    n0 = tl.program_id(0) * BLOCK_N
    rows, ks = n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        if TMA:
            acc += w_desc.load([n0, k]).to(tl.float32)
        else:
            acc += tl.load(w_ptr + rows[:, None] * sw_n + (k + ks)[None, :]).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def main(argv=None) -> dict:
    args = parse_args(__doc__, argv, quick="the engine's tilings only")

    from aligner.generation.native import pdl, splitk
    from benchmarks.decode_kernels import graph_time_us
    from benchmarks.ppo_step.workload import write_json

    B, dev, dt = args.batch, torch.device("cuda"), torch.bfloat16
    use_pdl = pdl.wanted(dev, B)
    torch.manual_seed(0)

    rand = randn(dev, dt)
    W = [dict(qkv=rand(QKV, HIDDEN), proj=rand(HIDDEN, HIDDEN), fc1=rand(2 * FFN, HIDDEN), fc2=rand(HIDDEN, FFN))
         for _ in range(LAYERS)]  # fmt: skip
    X = {"qkv": rand(B, HIDDEN, std=1), "proj": rand(B, HIDDEN, std=1), "fc1": rand(B, HIDDEN, std=1),
         "fc2": rand(B, FFN, std=1)}  # fmt: skip
    report = {"device": torch.cuda.get_device_name(dev), "batch": B, "pdl": use_pdl}
    launch = {"launch_pdl": True} if use_pdl else {}
    layer = itertools.count()

    def next_w(name):
        return W[next(layer) % LAYERS][name]

    def timed(call) -> float:
        return round(graph_time_us(call, calls=16, replays=20), 2)

    def run_tma(name, w, t: splitk.Tiling, out):
        x = X[name]
        desc = TensorDescriptor.from_tensor(w, [t.block_n, t.block_k])
        meta = dict(BLOCK_M=max(16, triton.next_power_of_2(B)), BLOCK_N=t.block_n, BLOCK_K=t.block_k, PDL=use_pdl,
                    num_warps=t.num_warps, num_stages=t.num_stages, **launch)  # fmt: skip
        if name == "fc1":
            grid = (FFN // t.block_n, 1, 1)
            tma_gated[grid](x, desc, out, B, HIDDEN, FFN, x.stride(0), out.stride(0), **meta)
        else:
            N, K = w.shape
            tma_splitk[(N // t.block_n, t.splits, 1)](
                x, desc, out, B, K // t.splits, x.stride(0), out.stride(0), out.stride(1), **meta
            )
        return out

    def run_ptr(name, w, t, out):
        if name == "fc1":
            return splitk.gated_matmul(X[name], w, t, out=out)
        return splitk.matmul(X[name], w, t, out=out)

    def out_for(name, t):
        if name == "fc1":
            return torch.empty(B, FFN, device=dev, dtype=dt)
        return torch.empty(t.splits, B, W[0][name].shape[0], device=dev)

    engine = {
        "fc1": splitk.gated_tiling_for(B, 2 * FFN, HIDDEN),
        "fc2": splitk.tiling_for(B, HIDDEN, FFN),
        "proj": splitk.tiling_for(B, HIDDEN, HIDDEN),
        "qkv": splitk.tiling_for(B, QKV, HIDDEN),
    }
    report["engine_tilings"] = {k: str(v) for k, v in engine.items()}

    # the two forms' results at the engine's tilings
    report["max_diff"] = {}
    for name, t in engine.items():
        a = run_ptr(name, W[0][name], t, out_for(name, t))
        b = run_tma(name, W[0][name], t, out_for(name, t))
        report["max_diff"][name] = (a.float() - b.float()).abs().max().item()
    print("max |pointer - TMA|", report["max_diff"], flush=True)

    # the read alone: each weight summed by rows, 16 layers in turn
    report["stream"] = {}
    sums = torch.empty(8192, device=dev)
    for name in ("proj", "qkv", "fc2", "fc1"):
        N, K = W[0][name].shape
        mib = N * K * 2 / 2**20
        for bn, bk, st in ((64, 128, 4), (64, 64, 5), (32, 128, 5), (128, 64, 4)):
            for tma in (False, True):

                def call(n=name, bn=bn, bk=bk, st=st, tma=tma, K=K, N=N):
                    w = next_w(n)
                    desc = TensorDescriptor.from_tensor(w, [bn, bk])
                    stream_rows[(N // bn,)](w, desc, sums, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk, TMA=tma,
                                            num_warps=4, num_stages=st)  # fmt: skip

                try:
                    us = timed(call)
                    report["stream"][f"{name} {bn}x{bk} s{st} {'tma' if tma else 'ptr'}"] = [
                        us,
                        round(mib / us * 2**20 / 1e6, 3),
                    ]
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    report.setdefault("failed", {})[f"stream {name} {bn} {bk} {st} {tma}"] = str(exc)[:120]
        best = {f: min((v for k, v in report["stream"].items() if k.startswith(name + " ") and k.endswith(f)),
                       key=lambda v: v[0], default=None) for f in ("ptr", "tma")}  # fmt: skip
        print("stream", name, f"{mib:.0f} MiB", "best ptr", best["ptr"], "tma", best["tma"], "(us, TB/s)", flush=True)

    # the GEMMs: pointer and TMA at each tiling
    def tilings(bns, splits, bks, stages):
        return [splitk.Tiling(bn, bk, s, 4, st) for bn in bns for s in splits for bk in bks for st in stages]

    grids = {
        "fc1": tilings((32, 64), (1,), (64, 128), (3, 4, 5, 6)),
        "fc2": tilings((64, 128), (2, 4), (64, 128), (4, 5, 6)),
        "proj": tilings((32, 64), (2, 4, 8), (64, 128), (4, 5)),
        "qkv": tilings((64, 128), (2, 4), (64, 128), (4, 5)),
    }
    if args.quick:
        grids = {name: [t] for name, t in engine.items()}
    report["gemm"] = {}
    for name, tilings in grids.items():
        rows = report["gemm"][name] = {}
        for t in tilings:
            if name != "fc1" and not t.fits(*W[0][name].shape):
                continue
            out = out_for(name, t)
            for form, fn in (("ptr", run_ptr), ("tma", run_tma)):
                key = f"{t.block_n}x{t.block_k} s{t.splits} st{t.num_stages} {form}"
                try:
                    rows[key] = timed(lambda n=name, t=t, o=out, fn=fn: fn(n, next_w(n), t, o))
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile or run is reported
                    report.setdefault("failed", {})[f"{name} {key}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        eng = f"{engine[name].block_n}x{engine[name].block_k} s{engine[name].splits} st{engine[name].num_stages} ptr"
        best = {
            f: min(((k, v) for k, v in rows.items() if k.endswith(f)), key=lambda kv: kv[1]) for f in ("ptr", "tma")
        }
        report[f"{name}_summary"] = {"engine": [eng, rows.get(eng)], "best_ptr": best["ptr"], "best_tma": best["tma"]}
        print(name, report[f"{name}_summary"], flush=True)
    h = X["qkv"]
    report["qkv_cublas"] = timed(lambda: F.linear(h, next_w("qkv")))
    print("qkv cuBLAS", report["qkv_cublas"], flush=True)
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
