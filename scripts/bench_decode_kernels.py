"""Time the decode step's kernels one at a time on a GPU: decode attention (matmul path vs the Triton kernel, with
its settings) and the weight GEMMs in several layouts (see benchmarks/decode_kernels.py).

    python scripts/bench_decode_kernels.py --out decode_kernels.json
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
    a = parser.parse_args(argv)
    try:
        report = run()
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
