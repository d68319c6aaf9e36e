"""How long a process's first checkpoint takes, with and without `dist_ckpt.start_writer()` at start-up.

Each measurement runs in a fresh interpreter (megatron's writer helper is started once per process): `child` builds
the CPU demo critic (conf/ppo_critic_demo.yaml's model with its optimizer), optionally calls start_writer (the call
timed, and how long the helper it starts in the background takes to be ready: the job's start-up work overlaps
that), then times three saves. `run(repeats)` gives the medians per setting,
`format_table` renders them; scripts/bench_checkpoint_writer.py is the entry. CPU only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
SAVES = 3
# The fresh interpreter imports this module from the checkout, then runs `child`.
CHILD = (
    "import sys; sys.path.insert(0, {root!r}); from benchmarks.checkpoint_writer import child; child({warm}, {ckpt!r})"
)


def child(warm: bool, ckpt_dir: str) -> None:
    """In the fresh process: time start_writer (if `warm`) and `SAVES` saves; prints one `RESULT {json}` line."""
    from aligner.checkpoint import dist_ckpt
    from aligner.config.critic import CriticJobConfig
    from aligner.config.loader import load_config
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    cfg = load_config(CriticJobConfig, "ppo_critic_demo")
    initialize(1, 1)
    model = TrainableModel(cfg.model, cfg.optim, head="scalar")
    out = {"start_writer_s": None, "ready_s": None}
    if warm:
        t0 = time.perf_counter()
        dist_ckpt.start_writer()
        out["start_writer_s"] = time.perf_counter() - t0
        dist_ckpt.wait_writer()
        out["ready_s"] = time.perf_counter() - t0
    saves = []
    for step in range(SAVES):
        t0 = time.perf_counter()
        dist_ckpt.save(ckpt_dir, step, [model.module], model.optimizer)
        saves.append(time.perf_counter() - t0)
    out["saves_s"] = saves
    print("RESULT " + json.dumps(out), flush=True)


def measure(warm: bool) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        code = CHILD.format(root=ROOT, warm=warm, ckpt=os.path.join(tmp, "ckpt"))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement failed:\n{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])


def run(repeats: int) -> list[tuple[str, float | None, float | None, list[float]]]:
    """(setting, median seconds of the start_writer call and until its helper is ready (None without it), median
    seconds of each save) for both settings."""
    rows = []
    for warm in (False, True):
        runs = [measure(warm) for _ in range(repeats)]
        med = [statistics.median(r["saves_s"][i] for r in runs) for i in range(SAVES)]
        start = statistics.median(r["start_writer_s"] for r in runs) if warm else None
        ready = statistics.median(r["ready_s"] for r in runs) if warm else None
        name = "start_writer at start-up" if warm else "megatron default (helper at first save)"
        rows.append((name, start, ready, med))
    return rows


def format_table(rows, repeats: int) -> str:
    lines = [
        f"median of {repeats} fresh processes, seconds",
        f"{'setting':42s} {'start_writer':>12s} {'ready after':>12s} "
        + " ".join(f"{f'save {i + 1}':>8s}" for i in range(SAVES)),
    ]
    for name, start, ready, med in rows:
        s, r = ("-" if x is None else f"{x:.2f}" for x in (start, ready))
        lines.append(f"{name:42s} {s:>12s} {r:>12s} " + " ".join(f"{x:8.2f}" for x in med))
    return "\n".join(lines)
