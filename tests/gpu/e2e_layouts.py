"""GPU end-to-end check on a two-GPU machine (issue 12; by hand, not collected by pytest):

    python tests/gpu/e2e_layouts.py OUT_DIR [--steps 2] [--only NAME ...] [--parallel] [--no-sigterm]
    (NAME: a layout below, or sigterm for the SIGTERM case alone)

For each layout below, the two jobs through `launchers/local/ppo.py` (the CPU demo's tiny model in bf16 on the
GPUs: every path of a real run, NCCL included): two PPO steps with a checkpoint, then the same command for one more
step (a resume). Checks per run: exit code 0, seconds from the last step to the launcher's exit (the TP=2 actor used
to hang here in destroy_process_group), KL exactly 0 at step 0, the engine/training log-prob mismatch against the
floor measured by the DP=2 layout (TP=1 ranks), the resume line, and that no process of the run is left. Then
SIGTERM in the middle of a longer run: both jobs checkpoint the same step and exit within the grace period.
Prints a table last and writes OUT_DIR/e2e_layouts.json.

Layouts (actor | critic, both jobs on the same two GPUs where they have two ranks):
  tp2:  actor TP=2 on GPUs 0,1 | critic DP=2 on GPUs 0,1
  pp2:  actor PP=2 on GPUs 0,1 | critic TP=2 on GPUs 0,1
  dp2:  actor DP=2 on GPUs 0,1 | critic on GPU 1
  dp2-overlap: as dp2, with optim.overlap_grad_reduce (several gradient buckets)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "launchers", "local", "ppo.py")
BF16 = ["model.params_dtype=bfloat16"]
LAYOUTS = {
    "tp2": dict(
        actor=["parallel.tensor_model_parallel_size=2"],
        critic=[],
        actor_gpus="0,1",
        critic_gpus="0,1",
        actor_procs=2,
        critic_procs=2,
    ),
    "pp2": dict(
        actor=["parallel.pipeline_model_parallel_size=2"],
        critic=["parallel.tensor_model_parallel_size=2"],
        actor_gpus="0,1",
        critic_gpus="0,1",
        actor_procs=2,
        critic_procs=2,
    ),
    "dp2": dict(actor=[], critic=[], actor_gpus="0,1", critic_gpus="1", actor_procs=2, critic_procs=1),
    # DP=2 with the gradient reduce overlapped with the backward (megatron's DDP buckets; small buckets: several)
    "dp2-overlap": dict(
        actor=["optim.overlap_grad_reduce=true", "optim.grad_bucket_size=20000"],
        critic=[],
        actor_gpus="0,1",
        critic_gpus="1",
        actor_procs=2,
        critic_procs=1,
    ),
}
COMMON = ["logging.progress_bar=false", "validation.every=0", "logging.samples_every=0", "checkpoint.save_every=0"]


def launch(exp: str, layout: dict, steps: int, popen: bool = False):
    cmd = [
        sys.executable, LAUNCHER, "--exp-dir", exp,
        "--actor-procs", str(layout["actor_procs"]), "--critic-procs", str(layout["critic_procs"]),
        "--actor-gpus", layout["actor_gpus"], "--critic-gpus", layout["critic_gpus"],
        "--actor", *COMMON, *BF16, f"ppo.num_steps={steps}", *layout["actor"],
        "--critic", *BF16, *layout["critic"],
    ]  # fmt: skip
    if popen:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    return proc, time.monotonic() - start


def metrics(exp: str) -> list[dict]:
    path = os.path.join(exp, "actor", "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def log_errors(exp: str) -> str:
    """The last traceback (or error line) of each job's log, for the report: the jobs' error replies carry no detail."""
    found = []
    for name in ("critic.log", os.path.join("actor", "actor.log"), "actor.log"):
        path = os.path.join(exp, name)
        if not os.path.exists(path):
            continue
        with open(path, errors="replace") as f:
            text = f.read()
        at = max(text.rfind("Traceback (most recent call last)"), text.rfind("Error"))
        if at >= 0:
            found.append(f"== {name}: " + text[max(0, at - 200) : at + 2500])
    return "\n".join(found)


def exit_lag(exp: str) -> float:
    """Seconds between the last metrics line and now (call right after the launcher returned)."""
    path = os.path.join(exp, "actor", "metrics.jsonl")
    return time.time() - os.path.getmtime(path) if os.path.exists(path) else float("nan")


def run_layout(name: str, out_dir: str, steps: int) -> dict:
    layout, exp = LAYOUTS[name], os.path.join(out_dir, name)
    first, seconds = launch(exp, layout, steps)
    lag = exit_lag(exp)
    rows = metrics(exp)
    result = {
        "layout": name,
        "rc": first.returncode,
        "seconds": round(seconds, 1),
        "exit_after_last_step_s": round(lag, 1),
        "kl_step0": rows[0].get("ppo/kl") if rows else None,
        "mismatch": max((r.get("ppo/logprob_mismatch", float("nan")) for r in rows), default=None),
        "steps": len(rows),
    }
    if first.returncode != 0:
        result["tail"] = (first.stdout + first.stderr)[-1500:]
        result["log_errors"] = log_errors(exp)
        return result
    second, _ = launch(exp, layout, steps + 1)
    rows = metrics(exp)
    result.update(
        resume_rc=second.returncode,
        resumed="resumed from" in second.stdout + second.stderr,
        steps_after_resume=[r["step"] for r in rows],
        resume_exit_after_last_step_s=round(exit_lag(exp), 1),
    )
    time.sleep(2)
    result["leftovers"] = leftovers(exp)
    if second.returncode != 0:
        result["tail"] = (second.stdout + second.stderr)[-1500:]
        result["log_errors"] = log_errors(exp)
    return result


def run_sigterm(out_dir: str) -> dict:
    exp = os.path.join(out_dir, "sigterm_tp2")
    proc = launch(exp, LAYOUTS["tp2"], 1000, popen=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(metrics(exp)) < 3 and proc.poll() is None:
        time.sleep(0.2)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()

    def ckpt(job):
        folder = os.path.join(exp, job, "checkpoints")
        return sorted(n for n in os.listdir(folder) if n.startswith("step_")) if os.path.isdir(folder) else []

    time.sleep(2)
    result = {
        "layout": "sigterm_tp2",
        "rc": proc.returncode,
        "stop_seconds": round(time.monotonic() - sent, 1),
        "actor_ckpt": ckpt("actor"),
        "critic_ckpt": ckpt("critic"),
        "steps": len(metrics(exp)),
        "leftovers": leftovers(exp),
    }
    if proc.returncode != 0:
        result["tail"] = out[-1500:]
        result["log_errors"] = log_errors(exp)
    return result


def judge(results: list[dict]) -> None:
    floor = next((r["mismatch"] for r in results if r["layout"] == "dp2" and r.get("mismatch") is not None), None)
    for r in results:
        ok = r["rc"] == 0 and not r.get("leftovers")
        if r["layout"] == "sigterm_tp2":
            ok = ok and r["actor_ckpt"] == r["critic_ckpt"] != [] and r["stop_seconds"] < 90
        else:
            ok = ok and r.get("resume_rc") == 0 and r.get("resumed") and r["kl_step0"] == 0.0
            ok = ok and r["exit_after_last_step_s"] < 30 and r.get("resume_exit_after_last_step_s", 99) < 30
            if floor is not None and r["mismatch"] is not None:
                r["mismatch_vs_floor"] = round(r["mismatch"] / max(floor, 1e-12), 2)
                ok = ok and r["mismatch"] <= 1.5 * floor + 1e-3
        r["verdict"] = "PASS" if ok else "FAIL"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--only", nargs="*", default=None, help="layouts to run (and sigterm); default: all")
    p.add_argument("--no-sigterm", action="store_true")
    p.add_argument("--parallel", action="store_true", help="run the layouts at the same time (the GPUs are shared)")
    a = p.parse_args()
    names = a.only or [*LAYOUTS, "sigterm"]
    unknown = [n for n in names if n not in LAYOUTS and n != "sigterm"]
    if unknown:
        p.error(f"unknown --only {' '.join(unknown)}: choose from {' '.join(LAYOUTS)} sigterm")
    sigterm = "sigterm" in names and not a.no_sigterm
    names = [n for n in names if n != "sigterm"]
    os.makedirs(a.out_dir, exist_ok=True)
    if a.parallel:
        from concurrent.futures import ThreadPoolExecutor, as_completed

        with ThreadPoolExecutor(len(names) + 1) as pool:
            jobs = [pool.submit(run_layout, name, a.out_dir, a.steps) for name in names]
            if sigterm:
                jobs.append(pool.submit(run_sigterm, a.out_dir))
            results = []
            for job in as_completed(jobs):  # each result as soon as it is there (a cut-short run keeps them)
                results.append(job.result())
                print(json.dumps(results[-1]), flush=True)
    else:
        results = []
        for name in names:
            results.append(run_layout(name, a.out_dir, a.steps))
            print(json.dumps(results[-1]), flush=True)
        if sigterm:
            results.append(run_sigterm(a.out_dir))
            print(json.dumps(results[-1]), flush=True)
    judge(results)
    with open(os.path.join(a.out_dir, "e2e_layouts.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(f"\n{'layout':12} {'verdict':7} {'rc':>3} {'s':>6} {'exit lag':>8} {'KL0':>5} {'mismatch':>9} {'resume':>7}")
    for r in results:
        print(
            f"{r['layout']:12} {r['verdict']:7} {r['rc']:>3} {r.get('seconds', r.get('stop_seconds', 0)):>6} "
            f"{r.get('exit_after_last_step_s', '-'):>8} {str(r.get('kl_step0', '-')):>5} "
            f"{r.get('mismatch') or 0:>9.2e} {str(r.get('steps_after_resume', r.get('actor_ckpt'))):>7}"
        )
    return 0 if all(r["verdict"] == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
