"""Helpers of the functional tests that run the two PPO jobs through launchers/local/ppo.py."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "launchers", "local", "ppo.py")


def _launch_cmd(exp_dir, *actor_overrides, critic=(), launcher_args=()):
    cmd = [sys.executable, LAUNCHER, "--exp-dir", str(exp_dir), *launcher_args]
    cmd += ["--actor", "logging.progress_bar=false", *actor_overrides]
    if critic:
        cmd += ["--critic", *critic]
    return cmd


def launch(exp_dir, *actor_overrides, timeout=900, critic=(), launcher_args=()):
    cmd = _launch_cmd(exp_dir, *actor_overrides, critic=critic, launcher_args=launcher_args)
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def launch_in_background(exp_dir, *actor_overrides, launcher_args=()):
    """A launch that runs while the test goes on (most of a tiny run is start-up and shut-down waiting, which two
    runs overlap well on two cores); `finish(proc)` waits for it."""
    cmd = _launch_cmd(exp_dir, *actor_overrides, launcher_args=launcher_args)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=900):
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def read_metrics(exp_dir):
    with open(os.path.join(exp_dir, "actor", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/")}
