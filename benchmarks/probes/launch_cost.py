"""Probe (issue 17, nineteenth session): the fixed cost of one kernel in a decode step's CUDA graph.

Two measurements on one GPU, each a chain of kernels captured in one CUDA graph (the engine's decode step is ~110
such kernels), with and without programmatic dependent launch (PDL, aligner.generation.native.pdl):
- a kernel that does nearly nothing (each program reads and writes one value), at 1, 132 and 528 programs: the cost
  of a launch in a chain;
- a kernel that reads a weight-like buffer of 1-32 MiB (16 distinct buffers in turn, so that reads come from HBM as
  in a step), summed per program: a line t = fixed + bytes / bandwidth through its times gives the fixed cost a
  memory-bound kernel pays on top of its bytes (ramp-up and tail of its wave of programs).

    python3 benchmarks/probes/launch_cost.py --out result.json     (CUDA; Triton)
"""

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.decode_kernels import graph_time_us  # noqa: E402
from benchmarks.ppo_step.workload import write_json  # noqa: E402


@triton.jit
def touch(x_ptr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    v = tl.load(x_ptr + i)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr + i, v + 1.0)


@triton.jit
def stream(w_ptr, out_ptr, n_per_prog, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    base = w_ptr + pid * n_per_prog
    acc = tl.zeros([BLOCK], tl.float32)
    for k in range(0, n_per_prog, BLOCK):
        acc += tl.load(base + k + tl.arange(0, BLOCK)).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + pid, tl.sum(acc))


def launch(kernel, grid, *args, pdl: bool, **meta):
    extra = {"launch_pdl": True} if pdl else {}
    kernel[grid](*args, PDL=pdl, **meta, **extra)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    report = {"device": torch.cuda.get_device_name(dev), "sms": sms, "touch_us": {}, "stream_us": {}}
    x = torch.zeros(4 * sms, device=dev)
    for programs in (1, sms, 4 * sms):
        for pdl in (False, True):
            us = graph_time_us(lambda p=programs, d=pdl: launch(touch, (p,), x, pdl=d), calls=200, replays=20)
            report["touch_us"][f"{programs} programs, pdl={pdl}"] = round(us, 3)
            print("touch", programs, pdl, round(us, 3), flush=True)
    out = torch.zeros(4 * sms, device=dev)
    for mib in (1, 2, 4, 8, 16, 32):
        n = mib * 2**20 // 2  # bf16 elements
        programs = 2 * sms
        per = -(-n // programs)
        per = -(-per // 1024) * 1024  # whole blocks per program
        actual = programs * per * 2 / 2**20
        bufs = [torch.randn(programs * per, device=dev).to(torch.bfloat16) for _ in range(16)]
        for pdl in (False, True):
            counter = iter(range(10**9))

            def call(d=pdl, b=bufs, p=per, g=programs, c=counter):
                launch(stream, (g,), b[next(c) % 16], out, p, BLOCK=1024, pdl=d, num_warps=8)

            us = graph_time_us(call, calls=32, replays=20)
            report["stream_us"][f"{mib} MiB, pdl={pdl}"] = round(us, 3)
            report.setdefault("stream_mib", {})[str(mib)] = round(actual, 4)
            print("stream", mib, round(actual, 3), pdl, round(us, 3), flush=True)
    for pdl in (False, True):  # least squares: us = fixed + MiB * per_mib
        pts = [(report["stream_mib"][str(m)], report["stream_us"][f"{m} MiB, pdl={pdl}"]) for m in (1, 2, 4, 8, 16, 32)]
        mx = sum(p[0] for p in pts) / len(pts)
        my = sum(p[1] for p in pts) / len(pts)
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
        report[f"stream_fit_pdl={pdl}"] = {
            "fixed_us": round(my - slope * mx, 3),
            "us_per_mib": round(slope, 4),
            "tb_per_s": round(2**20 / (slope * 1e-6) / 1e12, 3),
        }
        print("fit", pdl, report[f"stream_fit_pdl={pdl}"], flush=True)
    # the best read bandwidth this simple kernel reaches over its settings, at a step's weight sizes: what a
    # memory-bound kernel of that size can reach (the fit above used one setting)
    best = report["stream_best"] = {}
    for mib in (2, 8, 32):
        n = mib * 2**20 // 2
        for mult, block, warps in [(m, b, w) for m in (1, 2, 4, 8) for b in (1024, 4096) for w in (4, 8)]:
            programs = mult * sms
            per = triton.cdiv(triton.cdiv(n, programs), block) * block
            if programs * per > 1.1 * n:  # that setting cannot cut this size finely enough
                continue
            bufs = [torch.empty(programs * per, device=dev, dtype=torch.bfloat16).normal_() for _ in range(16)]
            counter = iter(range(10**9))

            def call(b=bufs, p=per, g=programs, c=counter, blk=block, nw=warps):
                launch(stream, (g,), b[next(c) % 16], out, p, BLOCK=blk, pdl=True, num_warps=nw)

            us = graph_time_us(call, calls=32, replays=20)
            tbs = programs * per * 2 / (us * 1e-6) / 1e12
            if tbs > best.get(str(mib), {}).get("tb_per_s", 0):
                best[str(mib)] = {
                    "us": round(us, 3),
                    "tb_per_s": round(tbs, 3),
                    "programs": programs,
                    "block": block,
                    "warps": warps,
                    "mib": round(programs * per * 2 / 2**20, 3),
                }
            del bufs
        print("best read", mib, best[str(mib)], flush=True)
    if args.out:
        write_json(args.out, report)
    return report


if __name__ == "__main__":
    main()
