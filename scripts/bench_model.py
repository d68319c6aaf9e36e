"""Time forward+backward of the megatron-core GPT model aligner builds, per attention backend.

    python scripts/bench_model.py --preset 1b --attention unfused,sdpa --batch 8 --seq 2048 [--out bench.json]
    python scripts/bench_model.py --preset 8b --attention sdpa --recompute none,full --batch 16 --seq 384
    python scripts/bench_model.py --preset tiny   # CPU smoke run

Prints a table: seconds per step, tokens/s, TFLOP/s (6ND and with attention), MFU against `--peak-tflops`, peak GB.
What is counted and how: benchmarks/model.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.parallel import initialize, shutdown  # noqa: E402
from benchmarks.model import PRESETS, format_table, run  # noqa: E402
from benchmarks.profiling import format_profile  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--attention", default="unfused,sdpa")
    p.add_argument("--recompute", default="none", help="model.recompute values, e.g. none,selective,full")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak (H200 here: ~790)")
    p.add_argument("--rope-fusion", default="auto", help="model.rope_fusion values, e.g. off,on")
    p.add_argument("--logprob-fusion", default="auto", help="model.logprob_fusion values, e.g. off,on")
    p.add_argument("--profile", action="store_true", help="also a top-kernels table of one step per row")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    batch = args.batch or (2 if args.preset == "tiny" else 8)
    seq = args.seq or (64 if args.preset == "tiny" else 2048)
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    initialize(seed=0)
    try:
        rows = run(
            args.preset,
            args.attention.split(","),
            batch,
            seq,
            dtype,
            args.warmup,
            args.iters,
            args.peak_tflops,
            recompute=tuple(args.recompute.split(",")),
            profile=args.profile,
            rope_fusion=tuple(args.rope_fusion.split(",")),
            logprob_fusion=tuple(args.logprob_fusion.split(",")),
        )
    finally:
        shutdown()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"\nforward+backward, preset {args.preset}, batch {batch} x {seq} tokens, {dtype}, {device}")
    print(format_table(rows))
    for r in rows:
        if "profile" in r:
            what = f"attention {r['attention']}, recompute {r['recompute']}, rope fusion {r['rope_fusion']}, "
            what += f"log-prob fusion {r['logprob_fusion']}"
            print(format_profile(r["profile"], f"one step, {what}"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "batch": batch,
                    "seq": seq,
                    "dtype": dtype,
                    "device": device,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
