"""The Slurm launchers against a real Slurm (tests/slurm/slurm_cluster.py: munged, slurmctld, 3 virtual nodes).

Heterogeneous job (launchers/slurm/ppo.sbatch): both components run and the job exits 0 with complete metrics; a
critic with a bad config fails the job at once with its error in the job's log; the time limit's --signal leaves
matching actor and critic checkpoints that the next job resumes. Both jobs on the same node
(launchers/slurm/ppo_colocated.sbatch, the same script's placement for a plain job): they take turns, and
`scancel --batch --signal=TERM` checkpoints both and the next job resumes. Two separate jobs
(launchers/slurm/two_jobs.sh). No process is left behind by any of them. CPU demo configs, a few steps each.
"""

import json
import os
import subprocess
import sys
import time

import pytest
from slurm.slurm_cluster import SlurmCluster, SlurmUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO = os.path.join(ROOT, "launchers", "slurm", "ppo.sbatch")
COLOCATED = os.path.join(ROOT, "launchers", "slurm", "ppo_colocated.sbatch")
TWO_JOBS = os.path.join(ROOT, "launchers", "slurm", "two_jobs.sh")
DEMO = ["--actor-config", "ppo_actor_demo", "--critic-config", "ppo_critic_demo"]
QUICK = ["validation.every=0", "checkpoint.save_every=0"]


@pytest.fixture(scope="module")
def cluster():
    try:
        c = SlurmCluster(nodes=3).start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm here: {exc}")
    try:
        yield c
    finally:
        c.stop(remove=not os.environ.get("ALIGNER_KEEP_SLURM"))  # ALIGNER_KEEP_SLURM=1 keeps its logs


def _env(cluster):
    return {**cluster.env(), "PYTHON": sys.executable}


def sbatch_wait(cluster, *args, timeout=300):
    """`sbatch --wait` (returns the job's exit status); the job's output lands in the returned file."""
    out = args[args.index("-o") + 1]
    try:
        proc = subprocess.run(
            ["timeout", str(timeout), "sbatch", "--wait", *args],
            cwd=ROOT,
            env=_env(cluster),
            capture_output=True,
            text=True,
            timeout=timeout + 30,
        )
    finally:
        cluster.run("scancel", "--user=root")  # nothing outlives a test that timed out
    with open(out) as f:
        return proc, f.read()


def submit(cluster, *args) -> str:
    proc = cluster.run("sbatch", "--parsable", *args, cwd=ROOT, env=_env(cluster))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def wait_gone(cluster, job_id, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job_id not in cluster.jobs():
            return
        time.sleep(0.5)
    cluster.run("scancel", job_id)
    pytest.fail(f"job {job_id} still in the queue after {timeout} s")


def job_field(cluster, job_id, name: str) -> str:
    """One field of `scontrol show job -o` (the het job leader's, for a het job)."""
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return next(f.split("=", 1)[1] for f in out.split() if f.startswith(f"{name}="))


def exit_code(cluster, job_id) -> str:
    return job_field(cluster, job_id, "ExitCode")


def wait_for_steps(cluster, job_id, exp, job_out, steps: int, timeout: float = 180) -> None:
    """Until the actor's metrics hold `steps` rows; fails with the job's and the critic's logs if the job ends or
    the time runs out first."""
    deadline = time.monotonic() + timeout
    mfile = exp / "actor" / "metrics.jsonl"
    while not (mfile.exists() and mfile.read_text().count("\n") >= steps):
        assert time.monotonic() < deadline and job_id in cluster.jobs(), job_out.read_text()[-4000:] + critic_logs(exp)
        time.sleep(0.5)


def critic_logs(exp, chars: int = 3000) -> str:
    """The ends of the critic's own log and of its tritonserver log, for a failing test's message."""
    out = []
    for path in sorted([*exp.glob("logs/*"), *exp.glob("critic/tritonserver.log")]):
        out.append(f"--- {path} ---\n{path.read_text(errors='replace')[-chars:]}")
    return "\n".join(out)


def metrics(exp):
    with open(os.path.join(exp, "actor", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def leftovers(marker: str, grace: float = 15.0) -> list[str]:
    """Processes whose command line mentions `marker`, and Triton python stubs whose workspace has been removed
    (a critic's, which it removes after its stubs have gone: one left is an orphan of a stopped critic), after
    giving them `grace` seconds to go away."""
    deadline = time.monotonic() + grace
    while True:
        out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        found = [
            line
            for line in out.splitlines()
            if (marker in line and "ps -eo" not in line) or _orphan_stub(line.split()[1:3])
        ]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _orphan_stub(program: list[str]) -> bool:
    """A stub's command line (its first words: the binary, or an interpreter and a script) naming a removed file."""
    return any(w.endswith("/triton_python_backend_stub") and not os.path.exists(w) for w in program)


def test_het_job_runs_critic_and_two_rank_actor(cluster, tmp_path):
    exp = tmp_path / "exp"
    # Component 0 (critic): 1 node; component 1 (actor): 2 nodes, one rank each, TP=2 (needs both ranks to start).
    proc, log = sbatch_wait(
        cluster,
        "-o",
        str(tmp_path / "job.out"),
        "-N1",
        ":",
        "-N2",
        PPO,
        *DEMO,
        "--exp-dir",
        str(exp),
        "--actor",
        "ppo.num_steps=3",
        "parallel.tensor_model_parallel_size=2",
        *QUICK,
    )
    assert proc.returncode == 0, log[-4000:] + critic_logs(exp)
    assert "critic on n1 (1/node), actor on n[2-3] (1/node)" in log
    rows = metrics(exp)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in ("rollout/reward_mean", "ppo/kl", "ppo/policy_loss", "critic/value_loss", "timing/step"):
        assert all(r.get(key) is not None for r in rows), key
    assert f"metrics: {exp}/actor/metrics.jsonl" in log
    assert sorted(n for n in os.listdir(exp / "actor" / "checkpoints") if n.startswith("step_")) == ["step_000003"]
    assert sorted(os.listdir(exp / "critic" / "checkpoints")) == ["step_000003"], "critic_save at the same step"
    (critic_log,) = (exp / "logs").iterdir()
    text = critic_log.read_text()
    assert "critic server ready at http://127.0.0.1:" in text and "SIGTERM received, stopping" in text
    assert not cluster.jobs()
    assert not leftovers(str(exp))


def test_failing_critic_fails_the_job_fast(cluster, tmp_path):
    exp = tmp_path / "exp"
    # A hang would run into the 120 s timeout (and its exit status 124) instead of the critic's status 2.
    proc, log = sbatch_wait(
        cluster,
        "-o",
        str(tmp_path / "job.out"),
        PPO,
        *DEMO,
        "--exp-dir",
        str(exp),
        "--critic",
        "train.epochs=0",
        timeout=120,
    )
    assert proc.returncode == 2, log[-4000:]
    assert "config error at 'train.epochs'" in log, "the critic's own error is shown in the job's log"
    assert "the critic job did not come up" in log
    assert not (exp / "actor").exists(), "the actor never started"
    assert not leftovers(str(exp))


def test_failing_actor_fails_the_job_and_stops_the_critic(cluster, tmp_path):
    exp, out = tmp_path / "exp", tmp_path / "job.out"
    job = submit(cluster, "-o", str(out), PPO, *DEMO, "--exp-dir", str(exp), "--actor", "ppo.micro_batch_size=5")
    try:
        wait_gone(cluster, job)
    finally:
        cluster.run("scancel", job)
    log = out.read_text()
    assert exit_code(cluster, job) != "0:0", log[-4000:]
    assert "ppo.micro_batch_size" in log and "the actor job failed" in log
    (critic_log,) = (exp / "logs").iterdir()
    assert "SIGTERM received, stopping" in critic_log.read_text(), "the critic is stopped cleanly after the actor"
    assert not leftovers(str(exp))


LONG_RUN = 100_000  # steps no run reaches: only the signal ends it, however fast the machine


def _stopped_run_resumes(cluster, tmp_path, exp, first_job_out, first_id, job=(PPO,)):
    """After a SIGTERM-stopped first job: matching checkpoints; a second job (sbatch options and script `job`)
    resumes both and completes."""
    wait_gone(cluster, first_id)
    log = first_job_out.read_text()
    assert exit_code(cluster, first_id) == "0:0", log[-4000:]
    assert "asking the actor to checkpoint and stop" in log
    rows = metrics(exp)
    stopped = len(rows)
    assert [r["step"] for r in rows] == list(range(stopped)) and stopped < LONG_RUN
    assert [n for n in os.listdir(exp / "actor" / "checkpoints") if n.startswith("step_")] == [f"step_{stopped:06d}"]
    assert os.listdir(exp / "critic" / "checkpoints") == [f"step_{stopped:06d}"]
    committed = json.loads((exp / "actor" / "checkpoints" / "committed.json").read_text())
    assert committed["steps"] == [stopped]
    assert (
        json.loads((exp / "actor" / "checkpoints" / f"step_{stopped:06d}" / "state.json").read_text())["step"]
        == stopped
    )
    assert not leftovers(str(exp))

    second = submit(
        cluster,
        "-o",
        str(tmp_path / "job2.out"),
        *job,
        *DEMO,
        "--exp-dir",
        str(exp),
        "--actor",
        f"ppo.num_steps={stopped + 2}",
        *QUICK,
    )
    wait_gone(cluster, second)
    log2 = (tmp_path / "job2.out").read_text()
    assert exit_code(cluster, second) == "0:0", log2[-4000:]
    assert f"resumed from {exp}/actor/checkpoints/step_{stopped:06d} at step {stopped}" in log2
    assert [r["step"] for r in metrics(exp)] == list(range(stopped + 2))
    critic_logs = sorted((exp / "logs").iterdir(), key=lambda p: int(p.stem.split("-")[1]))
    assert "starting fresh" in critic_logs[0].read_text()
    assert "starting fresh" not in critic_logs[1].read_text(), "the second critic resumed its checkpoint"
    assert sorted(os.listdir(exp / "critic" / "checkpoints"))[-1] == f"step_{stopped + 2:06d}"
    assert not leftovers(str(exp))


def test_colocated_jobs_take_turns_stop_and_resume(cluster, tmp_path):
    """ppo_colocated.sbatch: both jobs with two ranks each on the one node of a plain job, sharing its CPUs (as two
    GPUs would be shared); the actor takes turns with the critic. Then `scancel --batch --signal=TERM` (the batch
    script's signal handling and shutdown order are ppo.sbatch's, het or not) and the resume."""
    exp, out = tmp_path / "exp", tmp_path / "job.out"
    job = ("-N1", "-n2", "--export=ALL,ACTOR_TASKS_PER_NODE=2,CRITIC_TASKS_PER_NODE=2", COLOCATED)
    first = submit(
        cluster, "-o", str(out), *job, *DEMO, "--exp-dir", str(exp), "--actor", f"ppo.num_steps={LONG_RUN}", *QUICK
    )
    try:
        wait_for_steps(cluster, first, exp, out, 2)
        log = out.read_text()
        assert "critic on n1 (2/node), actor on n1 (2/node)" in log
        assert "the jobs share the nodes: they take turns (critic.overlap=false)" in log
        (critic_log,) = (exp / "logs").iterdir()
        assert "2 rank(s): TP 1, PP 1, DP 2" in critic_log.read_text()
        assert cluster.run("scancel", "--batch", "--signal=TERM", first).returncode == 0
        _stopped_run_resumes(cluster, tmp_path, exp, out, first, job)
    finally:
        cluster.run("scancel", first)


def run_seconds(cluster, job_id) -> int:
    """The job's RunTime (Slurm's [D-]HH:MM:SS) in seconds."""
    days, _, clock = job_field(cluster, job_id, "RunTime").rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


SIGNAL_AHEAD_S = 150  # --signal=B:TERM@150: the batch script's SIGTERM, this long before the time limit


def test_time_limit_signal_checkpoints_and_resumes(cluster, tmp_path):
    exp = tmp_path / "exp"
    out = tmp_path / "job.out"
    # Ten minutes of wall time at first; once the actor trains, the limit is cut (`scontrol update TimeLimit`, whole
    # minutes) to leave 90-150 s: inside --signal's 150 s, so Slurm sends SIGTERM to the batch script at its next
    # time-limit check (every 30 s), which leaves the actor at least a minute to checkpoint. A limit fixed at
    # submission either let the signal come before the actor had started (seen in CI with two minutes: the batch
    # script started 26 s after the allocation on a loaded machine) or kept the actor training for 90-120 s.
    job = submit(
        cluster,
        "-o",
        str(out),
        "--time=10",
        f"--signal=B:TERM@{SIGNAL_AHEAD_S}",
        ":",
        "--time=10",
        PPO,
        *DEMO,
        "--exp-dir",
        str(exp),
        "--actor",
        f"ppo.num_steps={LONG_RUN}",
        *QUICK,
    )
    try:
        wait_for_steps(cluster, job, exp, out, 1)
        minutes = (run_seconds(cluster, job) + SIGNAL_AHEAD_S) // 60
        update = cluster.run("scontrol", "update", f"JobId={job}", f"TimeLimit={minutes}")
        assert update.returncode == 0, update.stderr
        _stopped_run_resumes(cluster, tmp_path, exp, out, job)
    finally:
        cluster.run("scancel", job)


def test_two_separate_jobs(cluster, tmp_path):
    exp = tmp_path / "exp"
    proc = subprocess.run(
        [
            "timeout",
            "300",
            TWO_JOBS,
            "--wait",
            "--critic-sbatch",
            f"-o {tmp_path}/critic.out",
            "--actor-sbatch",
            f"-o {tmp_path}/actor.out",
            "--",
            *DEMO,
            "--exp-dir",
            str(exp),
            "--actor",
            "ppo.num_steps=2",
            *QUICK,
        ],
        cwd=ROOT,
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=330,
    )
    cluster.run("scancel", "--user=root")
    actor_log = (tmp_path / "actor.out").read_text()
    critic_log = (tmp_path / "critic.out").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr + actor_log[-3000:] + critic_log[-3000:]
    ids = dict(line.split() for line in proc.stdout.splitlines()[:2])
    assert f"critic job {ids['critic']}: exit status 0" in proc.stdout
    assert "address written to" in critic_log and "critic ended with status 0" in critic_log
    assert f"stopping critic job {ids['critic']}" in actor_log
    assert [r["step"] for r in metrics(exp)] == [0, 1]
    assert os.listdir(exp / "critic" / "checkpoints") == ["step_000002"]
    assert not (exp / "critic_address").exists()
    assert not leftovers(str(exp))
