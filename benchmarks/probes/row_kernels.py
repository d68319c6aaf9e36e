"""Probe (issue 17, twenty-first session): a decode step's row-wise pieces after its Triton GEMMs, the compiled
kernels (fused.py, the engine's) against one-program-per-row Triton kernels (rows.py).

A profile of an FP8 decode step at B=64 (bench_generation.py --profile) put the two add+norm+quantize kernels of a
layer at 3.6 us each and the activation's quantization at 3.6 us: ~175 us of a 1.04 ms step. Here, 16 layers'
distinct tensors in one CUDA graph, us per call, for the 1B model's sizes:

- add_parts_norm_q: 4 float32 partials [4, B, 2048] + residual, RMSNorm, quantized per row (FP8 decode);
- add_parts_norm: the same without the quantization (the bf16 decode path);
- q: the FP8 fc1 kernel's activation [B, 8192] quantized per row.

Each Triton form at 4, 8 and 16 warps; the largest difference to the compiled kernel's outputs.

    python3 benchmarks/probes/row_kernels.py --out result.json     (CUDA; Triton)
"""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import parse_args, randn  # noqa: E402

LAYERS, HIDDEN, FFN, SPLITS = 16, 2048, 8192, 4  # the 1B model of docs/PERF.md


def main(argv=None) -> dict:
    args = parse_args(__doc__, argv)

    from aligner.families import family
    from aligner.generation.native import fused, pdl, rows
    from benchmarks.decode_kernels import graph_time_us
    from benchmarks.ppo_step.workload import write_json

    B, dev, dt = args.batch, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rand = randn(dev, dt)
    L = [
        dict(
            x=rand(B, HIDDEN, std=1),
            parts=rand(SPLITS, B, HIDDEN, std=0.3).float(),
            w=1 + rand(HIDDEN, std=0.1),
            m=rand(B, FFN, std=0.5),
        )  # fmt: skip
        for _ in range(LAYERS)
    ]
    eps = 1e-5
    k = fused.make_kernels(family("llama"), eps, compile_=True, max_batch=B, pdl_device=dev)
    report = {"device": torch.cuda.get_device_name(dev), "batch": B, "pdl": pdl.wanted(dev, B)}

    def diff(got, ref):
        return [round((g.float() - r.float()).abs().max().item(), 6) for g, r in zip(got, ref)]

    def mismatch(got, ref):
        return [int((g.float() != r.float()).sum().item()) for g, r in zip(got, ref)]

    z = L[0]
    pairs = {
        "add_parts_norm_q": (
            k.add_parts_norm_q(z["x"], z["parts"], None, z["w"], None),
            rows.add_parts_norm(z["x"], z["parts"], None, z["w"], eps, quantize=True),
        ),
        "add_parts_norm": (
            k.add_parts_norm(z["x"], z["parts"], None, z["w"], None),
            rows.add_parts_norm(z["x"], z["parts"], None, z["w"], eps),
        ),
        "q": (k.q(z["m"]), rows.quantize_rows(z["m"])),
    }
    report["diff"] = {name: diff(got, ref) for name, (ref, got) in pairs.items()}
    report["elements_differing"] = {name: mismatch(got, ref) for name, (ref, got) in pairs.items()}
    print("diff", json.dumps(report["diff"]), json.dumps(report["elements_differing"]), flush=True)

    layer = itertools.count()

    def nxt():
        return L[next(layer) % LAYERS]

    def timed(call) -> float:
        return round(graph_time_us(call, calls=16, replays=50), 2)

    def apnq(n=None):
        z = nxt()
        return rows.add_parts_norm(z["x"], z["parts"], None, z["w"], eps, quantize=True, num_warps=n)

    def apn(n=None):
        z = nxt()
        return rows.add_parts_norm(z["x"], z["parts"], None, z["w"], eps, num_warps=n)

    def compiled(fn):
        z = nxt()
        return fn(z["x"], z["parts"], None, z["w"], None)

    times = {
        "add_parts_norm_q compiled": timed(lambda: compiled(k.add_parts_norm_q)),
        "add_parts_norm compiled": timed(lambda: compiled(k.add_parts_norm)),
        "q compiled": timed(lambda: k.q(nxt()["m"])),
    }
    for n in (4, 8, 16):
        times[f"add_parts_norm_q triton w{n}"] = timed(lambda n=n: apnq(n))
        times[f"add_parts_norm triton w{n}"] = timed(lambda n=n: apn(n))
        times[f"q triton w{n}"] = timed(lambda n=n: rows.quantize_rows(nxt()["m"], num_warps=n))
    report["us"] = times
    for name, t in times.items():
        print(f"{name:32s} {t:8.2f}", flush=True)
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
