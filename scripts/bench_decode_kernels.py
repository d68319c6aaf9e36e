"""Time the decode step's kernels one at a time on a GPU: decode attention (matmul path vs the Triton kernel, with
its settings) and the weight GEMMs in several layouts (see benchmarks/decode_kernels.py).

    python scripts/bench_decode_kernels.py --out decode_kernels.json
    python scripts/bench_decode_kernels.py --prefill --gemm-autotune   # also prefill's kernels, autotuned GEMMs
    python scripts/bench_decode_kernels.py --fp8                       # also the GEMMs in FP8
    python scripts/bench_decode_kernels.py --splitk 64 128             # also the split-K Triton GEMM's tilings
    python scripts/bench_decode_kernels.py --attention-products        # the attention's 16-bit vs TF32 products
    python scripts/bench_decode_kernels.py --gated 64 128              # fc1 + SwiGLU in one kernel vs cuBLAS + act
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_kernels import NeedsGPU, format_report, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--prefill", action="store_true", help="also prefill's compiled RoPE and norm, two ways")
    parser.add_argument("--gemm-autotune", action="store_true", help="also the GEMMs under max-autotune (minutes)")
    parser.add_argument("--fp8", action="store_true", help="also the weight GEMMs in FP8 (generation.decode_weights)")
    parser.add_argument(
        "--splitk",
        nargs="*",
        type=int,
        default=None,
        metavar="B",
        help="also the split-K Triton GEMM over its tilings at these batch sizes (default 64 128)",
    )
    parser.add_argument(
        "--attention-products", action="store_true", help="also the attention kernel's 16-bit vs TF32 products"
    )
    parser.add_argument(
        "--gated",
        nargs="*",
        type=int,
        default=None,
        metavar="B",
        help="also fc1 with its SwiGLU in one Triton kernel over its tilings at these batch sizes (default 64 128)",
    )
    a = parser.parse_args(argv)
    try:
        splitk = () if a.splitk is None else tuple(a.splitk or (64, 128))
        report = run(
            prefill=a.prefill,
            autotune=a.gemm_autotune,
            fp8=a.fp8,
            splitk=splitk,
            attention_products=a.attention_products,
            gated=() if a.gated is None else tuple(a.gated or (64, 128)),
        )
    except NeedsGPU as exc:
        print(f"bench_decode_kernels: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
