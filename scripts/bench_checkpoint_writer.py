"""How long a process's first checkpoints take, with megatron's default writer results queue and with dist_ckpt's own.

    python scripts/bench_checkpoint_writer.py [--repeats 3]

Each measurement runs in a fresh interpreter on the CPU demo critic (benchmarks/checkpoint_writer.py says how).
Prints a table of medians; CPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.checkpoint_writer import format_table, run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per setting (default 3)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    print(format_table(run(a.repeats), a.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
