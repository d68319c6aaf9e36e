"""Throughput of a supervised trainer (SFT, reward model, DPO) on a synthetic workload, through its real entry script.

    python scripts/bench_trainers.py --trainer sft|reward_model|dpo [--config NAME] [--steps 12] [--warmup 4]
        [--procs 1] [--rows 2048] [--prompt-tokens 256] [--response-tokens 768] [--out FILE] [KEY=VALUE ...]

Defaults: the trainer's base config (conf/<trainer>.yaml: the ~1B Llama-style model, bf16, random weights) on rows
of 256 prompt + 768 response tokens; KEY=VALUE overrides go to the trainer. Prints one table row (docs/PERF.md's
format) and writes the JSON summary to --out. What is measured and how: benchmarks/trainers.py.
    python scripts/bench_trainers.py --trainer sft --config sft_demo --steps 4 --warmup 1 --rows 64   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.trainers import format_row, run  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", required=True, choices=["sft", "reward_model", "dpo"])
    p.add_argument("--config", default=None, help="config name (default: the trainer's base config)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the summary")
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response-tokens", type=int, default=768)
    p.add_argument("--exp-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--out", default=None)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    workload = {"rows": args.rows, "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens}
    result = run(
        args.trainer,
        args.config or args.trainer,
        args.steps,
        args.warmup,
        args.procs,
        args.overrides,
        workload,
        args.exp_dir,
    )
    print("| trainer | procs | s/step | tokens/s | model TFLOP/s | padding | peak GB |")
    print(format_row(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
