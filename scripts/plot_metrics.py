"""Turn an actor job's metrics.jsonl into PNG curves.

    python scripts/plot_metrics.py results/demo/actor/metrics.jsonl [--out DIR] [--keys rollout/reward_mean ppo/kl ...]

Writes one PNG per metric group (rollout, ppo, critic, timing, val) into DIR (default: next to the metrics file,
in plots/), and prints the paths. Needs matplotlib (`pip install -e ".[plot]"`).
"""

import argparse
import json
import os
import sys
from collections import defaultdict


def read(path):
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{path}:{lineno}: not JSON ({exc.msg})") from exc
    if not rows:
        raise SystemExit(f"{path}: no metrics")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics")
    p.add_argument("--out", default=None)
    p.add_argument("--keys", nargs="*", default=None, help="only these metrics")
    args = p.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("matplotlib is needed: pip install -e '.[plot]'") from None
    rows = read(args.metrics)
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "plots")
    os.makedirs(out, exist_ok=True)
    groups = defaultdict(list)
    keys = sorted({k for r in rows for k in r if k != "step" and isinstance(r[k], (int, float))})
    for key in keys:
        if args.keys is None or key in args.keys:
            groups[key.split("/")[0] if "/" in key else "other"].append(key)
    written = []
    for group, names in sorted(groups.items()):
        cols = min(3, len(names))
        nrows = (len(names) + cols - 1) // cols
        fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3 * nrows), squeeze=False)
        for ax, name in zip(axes.flat, names):
            pts = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 50 else None)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(names) :]:
            ax.axis("off")
        fig.tight_layout()
        path = os.path.join(out, f"{group}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
