"""Outside Slurm: the actor job as `mpiexec -n 2 python scripts/train_ppo_actor.py ...` (the mpich wheel, ranks from
PMI_*) and as `torchrun --nproc-per-node 2 ...`, against a critic job, through launchers/local/ppo.py --launcher.

TP=2 makes the run impossible unless both processes join one world of two.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCHER = os.path.join(ROOT, "launchers", "local", "ppo.py")


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _run_or_report(cmd: list[str], env: dict, tmp_path, timeout: float = 600) -> subprocess.CompletedProcess:
    """The launcher, run to its end. Past `timeout` (a rank that never joined its world once hung this test: docs/
    PERF.md, thirty-fourth session) the test fails with what was running below the launcher (pid, parent, state,
    command line) and the output so far, and every one of those processes is killed, so that no mpiexec proxy keeps
    spinning through the rest of the suite."""
    import psutil

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = psutil.Process(proc.pid).children(recursive=True)
        lines = []
        for p in below:
            try:
                lines.append(f"{p.pid} {p.ppid()} {p.status()} {' '.join(p.cmdline())[:300]}")
                p.kill()
            except psutil.Error:
                pass
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(
            f"the launcher ran past {timeout} s (experiment {tmp_path}); below it:\n" + "\n".join(lines)
            + f"\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"
        )  # fmt: skip
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize(
    "launcher",
    [
        pytest.param(
            "mpiexec", marks=pytest.mark.skipif(_mpiexec() is None, reason="no mpiexec: pip install -e '.[mpi]'")
        ),
        "torchrun",
    ],
)
def test_two_rank_actor(tmp_path, launcher):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    proc = _run_or_report(
        [
            sys.executable,
            LAUNCHER,
            "--launcher",
            launcher,
            "--actor-procs",
            "2",
            "--exp-dir",
            str(tmp_path),
            "--actor",
            "ppo.num_steps=2",
            "parallel.tensor_model_parallel_size=2",
            "validation.every=0",
            "logging.progress_bar=false",
        ],
        env,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    head = "mpiexec -n 2 " if launcher == "mpiexec" else "torch.distributed.run --nproc-per-node 2 "
    assert head in proc.stdout and "train_ppo_actor.py --config-name ppo_actor_demo" in proc.stdout
    with open(tmp_path / "actor" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["ppo/logprob_mismatch"] < 1e-4 for r in rows), "TP=2 engine and training log-probs agree"
    assert sorted(os.listdir(tmp_path / "actor" / "checkpoints")) == ["committed.json", "step_000002"]
    time.sleep(1)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert not [line for line in ps.splitlines() if str(tmp_path) in line and "ps -eo" not in line]
