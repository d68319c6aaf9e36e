"""Probe (issue 17, twenty-first session): FP8 decode weights (`generation.decode_weights: fp8`) for qkv and the
output layer, by the split-K module's FP8 kernel.

With FP8 decode weights a B=64 decode step of the 1B model still reads qkv (16 MiB) and proj (8 MiB) in bf16 per
layer, and the output layer (62.5 MiB of e4m3) by cuBLAS's FP8 GEMM followed by a dequantizing kernel. Here, each
against the engine's form, 16 layers' distinct weights in one CUDA graph, us per call, tilings searched:

- qkv: cuBLAS bf16 (the engine before) / `splitk.matmul_fp8` from x quantized per row, one K range, bf16 out;
- output layer [V, H]: cuBLAS FP8 + dequantize (the engine before) / `splitk.matmul_fp8`, one K range, bf16 out.

Errors against float32 maths of the same quantized values. (At 4fbfff6 the probe also ran weight-only FP8 for qkv,
proj and the output layer, the e4m3 tile widened to bf16 inside the split-K kernel and x left in bf16: slower than
bf16 weights at both 64 and 128 rows, docs/PERF.md; that kernel form was not kept.)

    python3 benchmarks/probes/fp8_attention_gemms.py --out result.json     (CUDA, sm_89+; Triton)
"""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import parse_args, randn  # noqa: E402

LAYERS, HIDDEN, QKV, VOCAB = 16, 2048, 4096, 32000  # the 1B model of docs/PERF.md


def main(argv=None) -> dict:
    args = parse_args(__doc__, argv)

    from aligner.families import family
    from aligner.generation.native import fp8, fused, pdl, splitk
    from benchmarks.decode_kernels import graph_time_us
    from benchmarks.ppo_step.workload import write_json

    B, dev, dt = args.batch, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rand = randn(dev, dt)
    W = []
    for _ in range(LAYERS):
        qkv, proj = rand(QKV, HIDDEN), rand(HIDDEN, HIDDEN)
        q8, qs = fp8.quantize_rows(qkv)
        W.append(dict(qkv=qkv, proj=proj, q8=q8, qs=qs.view(-1)))
    out_w = rand(VOCAB, HIDDEN)
    o8, os_ = fp8.quantize_rows(out_w)
    os_ = os_.view(-1)
    h = rand(B, HIDDEN, std=1)
    h8, hs = fp8.quantize_rows(h)
    hs = hs.view(-1).contiguous()
    one = torch.ones((), device=dev)
    k = fused.make_kernels(family("llama"), 1e-5, compile_=True, max_batch=B, pdl_device=dev)
    report = {"device": torch.cuda.get_device_name(dev), "batch": B, "pdl": pdl.wanted(dev, B)}

    def err(got, ref):
        return round((got.float() - ref).abs().max().item(), 5)

    w = W[0]
    ref_qkv_q = (h8.float() * hs[:, None]) @ (w["q8"].float() * w["qs"][:, None]).t()
    ref_out = (h8.float() * hs[:, None]) @ (o8.float() * os_[:, None]).t()
    t1 = splitk.Tiling(32, 128, 1, 4, 4)
    report["err"] = {
        "qkv_fp8": err(splitk.matmul_fp8(h8, hs, w["q8"], w["qs"], t1, dt), ref_qkv_q),
        "qkv_cublas_bf16_vs_unquantized": err(h @ w["qkv"].t(), h.float() @ w["qkv"].float().t()),
        "qkv_absmax": round(ref_qkv_q.abs().max().item(), 4),
        "out_fp8": err(splitk.matmul_fp8(h8, hs, o8, os_, splitk.Tiling(64, 128, 1), dt), ref_out),
        "out_cublas": err(fp8.dequantize(fp8.matmul(h8, o8, one), hs[:, None], os_, dt), ref_out),
        "out_absmax": round(ref_out.abs().max().item(), 4),
    }
    print("errors", json.dumps(report["err"]), flush=True)

    layer = itertools.count()

    def timed(call) -> float:
        return round(graph_time_us(call, calls=16, replays=20), 2)

    def nxt():
        return W[next(layer) % LAYERS]

    def search(name, run, block_ns, block_ks, splits_list, warps_list=(4,), stages_list=(3, 4, 5)):
        results = {}
        for bn, bk, sp, wp, st in itertools.product(block_ns, block_ks, splits_list, warps_list, stages_list):
            t = splitk.Tiling(bn, bk, sp, wp, st)
            try:
                results[f"{bn}x{bk} s{sp} w{wp} st{st}"] = timed(lambda t=t: run(t))
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile or run is reported
                report.setdefault("failed", {})[f"{name} {bn}x{bk} s{sp}"] = f"{type(exc).__name__}: {str(exc)[:100]}"
        best = min(results, key=results.get)
        report[name] = {"best": best, "best_us": results[best], "all": results}
        print(name, "best", best, results[best], flush=True)

    report["engine"] = {
        "qkv_cublas_bf16": timed(lambda: torch.matmul(h, nxt()["qkv"].t())),
        "proj_splitk_bf16": timed(lambda: splitk.matmul(h, nxt()["proj"], splitk.tiling_for(B, HIDDEN, HIDDEN))),
        "out_cublas_fp8_dq": timed(lambda: k.dq(fp8.matmul(h8, o8, one), hs[:, None], os_, dt)),  # the compiled kernel
        "out_cublas_fp8_only": timed(lambda: fp8.matmul(h8, o8, one)),
        "out_cublas_bf16": timed(lambda: torch.matmul(h, out_w.t())),
    }
    print("engine", report["engine"], flush=True)
    narrow = ((16, 32, 64), (128, 256), (1,))
    search("qkv_fp8", lambda t: splitk.matmul_fp8(h8, hs, nxt()["q8"], W[0]["qs"], t, dt), *narrow)
    search("out_fp8", lambda t: splitk.matmul_fp8(h8, hs, o8, os_, t, dt), (32, 64, 128), (128, 256), (1,))
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
