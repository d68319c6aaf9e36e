"""How long a process's first checkpoint takes, with and without `dist_ckpt.start_writer()` at start-up.

    python scripts/bench_checkpoint_writer.py [--repeats 3]

Each measurement runs in a fresh interpreter (megatron's writer helper is started once per process): it builds the
CPU demo critic (conf/ppo_critic_demo.yaml's model with its optimizer), optionally calls start_writer (timed
separately: the job pays it at start-up), then times three saves. Prints a table of medians; CPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, os, sys, time
sys.path.insert(0, {root!r})


def main():
    from aligner.checkpoint import dist_ckpt
    from aligner.config.critic import CriticJobConfig
    from aligner.config.loader import load_config
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    cfg = load_config(CriticJobConfig, "ppo_critic_demo")
    initialize(1, 1)
    model = TrainableModel(cfg.model, cfg.optim, head="scalar")
    out = {{"start_writer_s": None}}
    if {warm}:
        t0 = time.perf_counter()
        dist_ckpt.start_writer()
        out["start_writer_s"] = time.perf_counter() - t0
    saves = []
    for step in range(3):
        t0 = time.perf_counter()
        dist_ckpt.save({root_dir!r}, step, [model.module], model.optimizer)
        saves.append(time.perf_counter() - t0)
    out["saves_s"] = saves
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
"""


def measure(warm: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "child.py")
        with open(script, "w") as f:
            f.write(CHILD.format(root=ROOT, warm=warm, root_dir=os.path.join(tmp, "ckpt")))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement failed:\n{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per setting (default 3)")
    a = p.parse_args(argv)
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    rows = []
    for warm in (False, True):
        runs = [measure(warm) for _ in range(a.repeats)]
        med = [statistics.median(r["saves_s"][i] for r in runs) for i in range(3)]
        start = statistics.median(r["start_writer_s"] for r in runs) if warm else None
        rows.append(("start_writer at start-up" if warm else "megatron default (helper at first save)", start, med))
    print(f"median of {a.repeats} fresh processes, seconds")
    print(f"{'setting':42s} {'start_writer':>12s} {'save 1':>8s} {'save 2':>8s} {'save 3':>8s}")
    for name, start, med in rows:
        s = "-" if start is None else f"{start:.2f}"
        print(f"{name:42s} {s:>12s} " + " ".join(f"{x:8.2f}" for x in med))
    return 0


if __name__ == "__main__":
    sys.exit(main())
