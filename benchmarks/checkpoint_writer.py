"""How long a process's first checkpoints take: megatron's default writer results queue (a 'spawn' Manager process,
started inside the first save) against the queue of the process itself that `dist_ckpt.save` gives it
(`dist_ckpt.use_local_results_queue`).

Each measurement runs in a fresh interpreter (the queue is created once per process): `child` builds the CPU demo
critic (conf/ppo_critic_demo.yaml's model with its optimizer), then times `SAVES` saves and records the CPU seconds
of the process and of its children (a helper counts there once it has exited) and the children still alive after
the saves. For megatron's default, `child` creates megatron's own queue in the first save (use_local_results_queue
made a no-op). `run(repeats)` gives the medians per setting, `format_table` renders them;
scripts/bench_checkpoint_writer.py is the entry. CPU only.
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
SETTINGS = {"megatron": "megatron's default (a Manager process, started in save 1)", "local": "the process's own queue"}
# The fresh interpreter imports this module from the checkout, then runs `child`.
CHILD = (
    "import sys; sys.path.insert(0, {root!r}); from benchmarks.checkpoint_writer import child; "
    "child({setting!r}, {ckpt!r})"
)


def child(setting: str, ckpt_dir: str) -> None:
    """In the fresh process: time `SAVES` saves; prints one `RESULT {json}` line."""
    import psutil

    from aligner.checkpoint import dist_ckpt
    from aligner.config.critic import CriticJobConfig
    from aligner.config.loader import load_config
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    if setting == "megatron":
        dist_ckpt.use_local_results_queue = lambda: None
    cfg = load_config(CriticJobConfig, "ppo_critic_demo")
    initialize(1, 1)
    model = TrainableModel(cfg.model, cfg.optim, head="scalar")
    me = psutil.Process()
    saves, cpu0 = [], me.cpu_times()
    for step in range(SAVES):
        t0 = time.perf_counter()
        dist_ckpt.save(ckpt_dir, step, [model.module], model.optimizer)
        saves.append(time.perf_counter() - t0)
    cpu1 = me.cpu_times()
    alive = me.children(recursive=True)
    helper_cpu = sum(c.cpu_times().user + c.cpu_times().system for c in alive)
    own = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    done = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
    out = {"saves_s": saves, "cpu_s": own + done + helper_cpu, "children_alive": len(alive)}
    print("RESULT " + json.dumps(out), flush=True)


def measure(setting: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        code = CHILD.format(root=ROOT, setting=setting, ckpt=os.path.join(tmp, "ckpt"))
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            env.pop(key, None)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"measurement failed:\n{proc.stderr[-3000:]}")
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[len("RESULT ") :])


def run(repeats: int) -> list[tuple[str, list[float], float, int]]:
    """(setting, median seconds of each save, median CPU seconds of the saves (helper included), children alive
    after them) for both settings."""
    rows = []
    for setting, name in SETTINGS.items():
        runs = [measure(setting) for _ in range(repeats)]
        med = [statistics.median(r["saves_s"][i] for r in runs) for i in range(SAVES)]
        cpu = statistics.median(r["cpu_s"] for r in runs)
        rows.append((name, med, cpu, max(r["children_alive"] for r in runs)))
    return rows


def format_table(rows, repeats: int) -> str:
    lines = [
        f"median of {repeats} fresh processes, seconds",
        f"{'results queue':58s} " + " ".join(f"{f'save {i + 1}':>8s}" for i in range(SAVES)) + "   CPU s  children",
    ]
    for name, med, cpu, alive in rows:
        lines.append(f"{name:58s} " + " ".join(f"{x:8.2f}" for x in med) + f" {cpu:7.2f} {alive:9d}")
    return "\n".join(lines)
