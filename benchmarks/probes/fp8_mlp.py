"""Probe (issue 17, twentieth session): the FP8 decode MLP (`generation.decode_weights: fp8`) in two Triton kernels.

The engine's FP8 MLP at decode (decoder._mlp_fp8) is five kernels: add+norm+quantize (h8, one scale per row), cuBLAS
FP8 fc1 (bf16 result), the activation kernel (dequantize, SwiGLU, quantize per row: a reduction over all 8192
values of a row), cuBLAS FP8 fc2 (float32 result), dequantize+add+norm. cuBLAS reads fc1's 32 MiB of e4m3 in
~12.6 us and fc2's 16 MiB in ~9.3 (floors 8.0 and 4.0 at 4.2 TB/s; docs/PERF.md, twelfth session), none of them
launched with PDL. Here:

- `gated_fp8`: fc1 + SwiGLU as the bf16 gated kernel does it (splitk.gated_matmul), FP8 tensor-core products of h8
  and the e4m3 weight, both scales applied to the float32 sums, and the activation quantized on the spot: one scale
  per row and per block of BLOCK_N columns (each program's own tile: no reduction across programs);
- `splitk_fp8`: fc2 over K ranges as splitk.matmul, the activation's block scales applied to each K step's product
  (K step = the activation's block), the weight's row scales at the end; float32 partial sums that the existing
  add_parts_norm kernel adds into the residual stream.

Both against the engine's FP8 chain and its bf16 chain for the same MLP half, 16 layers' weights in one CUDA graph,
us per layer; errors against float32 maths of the same quantized weights.

    python3 benchmarks/probes/fp8_mlp.py --out result.json     (CUDA, sm_89+; Triton)
"""

import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import parse_args, randn  # noqa: E402

LAYERS, HIDDEN, FFN, EPS = 16, 2048, 8192, 1e-5  # the 1B model of docs/PERF.md
E4M3_MAX = 448.0


@triton.jit
def gated_fp8(
    x8_ptr, xs_ptr, w8_ptr, ws_ptr, a8_ptr, as_ptr, M, K, F, sx_m, sw_n, sa_m, sas_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """a = silu(g) * u, g = (x8 @ Wg8^T) * xs[row] * ws[col], u likewise with Wu8 = rows F.. of w8; a quantized to
    e4m3 with one scale per row and per BLOCK_N columns: a ~ a8 * as[row, col // BLOCK_N]."""
    pid = tl.program_id(0)
    n0 = pid * BLOCK_N
    rows, cols, ks = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ok = rows < M
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x8_ptr + rows[:, None] * sx_m + (k + ks)[None, :], mask=row_ok[:, None], other=0.0)
        g = tl.load(w8_ptr + cols[:, None] * sw_n + (k + ks)[None, :])
        u = tl.load(w8_ptr + (F + cols)[:, None] * sw_n + (k + ks)[None, :])
        if WIDEN:  # Triton's interpreter (CPU): float32 products of the same values
            x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(x, tl.trans(g), acc_g)
        acc_u = tl.dot(x, tl.trans(u), acc_u)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    gate = acc_g * xs[:, None] * tl.load(ws_ptr + cols)[None, :]
    up = acc_u * xs[:, None] * tl.load(ws_ptr + F + cols)[None, :]
    a = gate / (1.0 + tl.exp(-gate)) * up
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-12) / 448.0
    a8 = (a / scale[:, None]).to(a8_ptr.dtype.element_ty)
    tl.store(a8_ptr + rows[:, None] * sa_m + cols[None, :], a8, mask=row_ok[:, None])
    tl.store(as_ptr + rows * sas_m + pid, scale, mask=row_ok)


@triton.jit
def splitk_fp8(
    a8_ptr, as_ptr, w8_ptr, ws_ptr, out_ptr, M, K_SPLIT, sa_m, sas_m, sw_n, so_s, so_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, WIDEN: tl.constexpr,
):  # fmt: skip
    """Float32 partial sums out[s] = sum over K range s of (a8 * as) @ (w8 * ws)^T, as's blocks BLOCK_K wide."""
    n0, s = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    rows, cols, ks = tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
    k0 = s * K_SPLIT
    if PDL:
        tl.extra.cuda.gdc_wait()
    row_ok = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k0 + K_SPLIT, BLOCK_K):
        a = tl.load(a8_ptr + rows[:, None] * sa_m + (k + ks)[None, :], mask=row_ok[:, None], other=0.0)
        w = tl.load(w8_ptr + cols[:, None] * sw_n + (k + ks)[None, :])
        sa = tl.load(as_ptr + rows * sas_m + k // BLOCK_K, mask=row_ok, other=0.0)
        if WIDEN:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w)) * sa[:, None]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    acc = acc * tl.load(ws_ptr + cols)[None, :]
    tl.store(out_ptr + s * so_s + rows[:, None] * so_m + cols[None, :], acc, mask=row_ok[:, None])


def run_gated(x8, xs, w8, ws, a8, a_s, block_n, block_k, warps, stages, pdl_on):
    M, K = x8.shape
    F_ = w8.shape[0] // 2
    extra = {"launch_pdl": True} if pdl_on else {}
    gated_fp8[(F_ // block_n,)](
        x8, xs, w8, ws, a8, a_s, M, K, F_, x8.stride(0), w8.stride(0), a8.stride(0), a_s.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_on,
        WIDEN=x8.device.type != "cuda", num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip


def run_splitk(a8, a_s, w8, ws, out, block_n, block_k, splits, warps, stages, pdl_on):
    M, K = a8.shape
    N = w8.shape[0]
    extra = {"launch_pdl": True} if pdl_on else {}
    splitk_fp8[(N // block_n, splits)](
        a8, a_s, w8, ws, out, M, K // splits, a8.stride(0), a_s.stride(0), w8.stride(0), out.stride(0), out.stride(1),
        BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl_on,
        WIDEN=a8.device.type != "cuda", num_warps=warps, num_stages=stages, **extra,
    )  # fmt: skip


def main(argv=None) -> dict:
    args = parse_args(__doc__, argv)

    from aligner.families import family
    from aligner.generation.native import fp8, fused, pdl, splitk
    from benchmarks.decode_kernels import graph_time_us
    from benchmarks.ppo_step.workload import write_json

    B, dev, dt = args.batch, torch.device("cuda"), torch.bfloat16
    use_pdl = pdl.wanted(dev, B)
    torch.manual_seed(0)

    rand = randn(dev, dt)
    W = []
    for _ in range(LAYERS):
        fc1, fc2 = rand(2 * FFN, HIDDEN), rand(HIDDEN, FFN)
        (w1, s1), (w2, s2) = fp8.quantize_rows(fc1), fp8.quantize_rows(fc2)
        W.append(dict(fc1=fc1, fc2=fc2, w1=w1, s1=s1.view(-1), w2=w2, s2=s2.view(-1), g=1 + rand(HIDDEN, std=0.1)))
    X = rand(B, HIDDEN, std=1)
    P_in = torch.randn(4, B, HIDDEN, device=dev) * 0.25
    k = fused.make_kernels(family("llama"), EPS, compile_=True, max_batch=B, pdl_device=dev)
    one = torch.ones((), device=dev)
    report = {"device": torch.cuda.get_device_name(dev), "batch": B, "pdl": use_pdl}

    # one layer: the new kernels and the engine's FP8 chain against float32 maths of the same quantized values
    w = W[0]
    x1, h8, hs = k.add_parts_norm_q(X, P_in, None, w["g"], None)
    h_deq = h8.float() * hs
    gate, up = (h_deq @ (w["w1"].float() * w["s1"][:, None]).t()).split(FFN, -1)
    ref_act = F.silu(gate) * up
    ref_fc2 = ref_act @ (w["w2"].float() * w["s2"][:, None]).t()
    a8 = torch.empty(B, FFN, device=dev, dtype=fp8.E4M3)
    a_s = torch.empty(B, FFN // 64, device=dev)
    parts = torch.empty(4, B, HIDDEN, device=dev)
    run_gated(h8, hs.view(-1), w["w1"], w["s1"], a8, a_s, 64, 128, 4, 4, use_pdl)
    act_new = a8.float() * a_s.repeat_interleave(64, dim=1)
    run_splitk(a8, a_s, w["w2"], w["s2"], parts, 64, 64, 4, 4, 5, use_pdl)
    y1 = fp8.matmul(h8, w["w1"], one, dt)
    m8, ms = k.act_q(y1, hs, w["s1"], None, dt)
    y_engine = fp8.matmul(m8, w["w2"], one) * ms * w["s2"]
    scale = ref_act.abs().max().item()
    report["err"] = {
        "act_new": (act_new - ref_act).abs().max().item(),
        "act_engine": (m8.float() * ms - ref_act).abs().max().item(),
        "act_absmax": scale,
        "fc2_new": (parts.sum(0) - ref_fc2).abs().max().item(),
        "fc2_engine": (y_engine - ref_fc2).abs().max().item(),
        "fc2_absmax": ref_fc2.abs().max().item(),
        # the fc2 kernel alone, from the new activation exactly as stored
        "fc2_new_own_input": (parts.sum(0) - act_new @ (w["w2"].float() * w["s2"][:, None]).t()).abs().max().item(),
    }
    print("errors", json.dumps(report["err"]), flush=True)

    layer = itertools.count()

    def timed(call) -> float:
        return round(graph_time_us(call, calls=16, replays=20), 2)

    # each kernel alone over 16 layers' weights, its settings searched
    report["gated"] = {}
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5)):
        key = f"{bn}x{bk} w{warps} s{stages}"
        a_s_b = torch.empty(B, FFN // bn, device=dev)
        try:
            report["gated"][key] = timed(lambda bn=bn, bk=bk, wp=warps, st=stages, t=a_s_b: run_gated(
                h8, hs.view(-1), W[next(layer) % LAYERS]["w1"], W[0]["s1"], a8, t, bn, bk, wp, st, use_pdl)
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a setting that does not compile or run is reported
            report.setdefault("failed", {})[f"gated {key}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    best_g = min(report["gated"], key=report["gated"].get)
    print("gated best", best_g, report["gated"][best_g], flush=True)
    report["splitk"] = {}
    for bn, splits, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (4, 8), (3, 4, 5, 6)):
        key = f"{bn} s{splits} w{warps} st{stages}"
        out = torch.empty(splits, B, HIDDEN, device=dev)
        try:
            report["splitk"][key] = timed(lambda bn=bn, sp=splits, wp=warps, st=stages, o=out: run_splitk(
                a8, a_s, W[next(layer) % LAYERS]["w2"], W[0]["s2"], o, bn, 64, sp, wp, st, use_pdl)
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            report.setdefault("failed", {})[f"splitk {key}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
    best_s = min(report["splitk"], key=report["splitk"].get)
    print("splitk best", best_s, report["splitk"][best_s], flush=True)
    report["engine_alone"] = {
        "fc1_cublas_fp8": timed(lambda: fp8.matmul(h8, W[next(layer) % LAYERS]["w1"], one, dt)),
        "act_q": timed(lambda: k.act_q(y1, hs, W[next(layer) % LAYERS]["s1"], None, dt)),
        "fc2_cublas_fp8": timed(lambda: fp8.matmul(m8, W[next(layer) % LAYERS]["w2"], one)),
    }
    print("engine's FP8 kernels alone", report["engine_alone"], flush=True)

    # the MLP half over 16 layers: engine bf16, engine FP8, new FP8; us per layer
    g_bn, g_bk, g_w, g_s = (int(v.lstrip("ws")) for v in best_g.replace("x", " ").split())
    s_parts = best_s.split()
    s_bn, s_sp, s_w, s_st = int(s_parts[0]), int(s_parts[1][1:]), int(s_parts[2][1:]), int(s_parts[3][2:])
    t_gated, t_fc2 = splitk.gated_tiling_for(B, 2 * FFN, HIDDEN), splitk.tiling_for(B, HIDDEN, FFN)
    a_s_best = torch.empty(B, FFN // g_bn, device=dev)
    parts_best = torch.empty(s_sp, B, HIDDEN, device=dev)
    fc2_parts = torch.empty(4, B, HIDDEN, device=dev)

    def chain_fp8_engine():
        x = X
        for w in W:
            x, h8_, hs_ = k.add_parts_norm_q(x, P_in, None, w["g"], None)
            m8_, ms_ = k.act_q(fp8.matmul(h8_, w["w1"], one, dt), hs_, w["s1"], None, dt)
            x, _ = k.dq_add_norm(x, fp8.matmul(m8_, w["w2"], one), ms_, w["s2"], None, w["g"], None)

    def chain_fp8_new():
        x = X
        for w in W:
            x, h8_, hs_ = k.add_parts_norm_q(x, P_in, None, w["g"], None)
            run_gated(h8_, hs_.view(-1), w["w1"], w["s1"], a8, a_s_best, g_bn, g_bk, g_w, g_s, use_pdl)
            # the fc2 kernel's K step is the activation's block
            run_splitk(a8, a_s_best, w["w2"], w["s2"], parts_best, s_bn, g_bn, s_sp, s_w, s_st, use_pdl)
            x, _ = k.add_parts_norm(x, parts_best, None, w["g"], None)

    def chain_bf16_with_next_norm():
        x = X
        for w in W:
            x, h = k.add_parts_norm(x, P_in, None, w["g"], None)
            splitk.matmul(splitk.gated_matmul(h, w["fc1"], t_gated), w["fc2"], t_fc2, out=fc2_parts)
            x, _ = k.add_parts_norm(x, fc2_parts, None, w["g"], None)

    report["chains"] = {}
    for _ in range(2):
        for name, chain in (("bf16", chain_bf16_with_next_norm), ("fp8_engine", chain_fp8_engine),
                            ("fp8_new", chain_fp8_new)):  # fmt: skip
            report["chains"].setdefault(name, []).append(round(graph_time_us(chain, calls=2, replays=20) / LAYERS, 2))
    print("MLP half with the next norm, us per layer", report["chains"], flush=True)
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
