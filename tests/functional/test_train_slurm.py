"""launchers/slurm/train.sbatch against a real Slurm (tests/slurm/slurm_cluster.py): a two-rank SFT demo job completes
with its metrics; `scancel --batch --signal=TERM` makes the trainer checkpoint and the job exit 0, and the same
command submitted again resumes from that checkpoint; a config mistake fails the job with the key in its log."""

import json
import os
import sys
import time

import pytest
from slurm.slurm_cluster import SlurmCluster, SlurmUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(ROOT, "launchers", "slurm", "train.sbatch")
SFT_DEMO = ["--trainer", "sft", "--config", "sft_demo"]


@pytest.fixture(scope="module")
def cluster():
    try:
        c = SlurmCluster(nodes=1).start()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm here: {exc}")
    try:
        yield c
    finally:
        c.stop(remove=not os.environ.get("ALIGNER_KEEP_SLURM"))


def submit(cluster, out, *args, **env) -> str:
    env = {**cluster.env(), "PYTHON": sys.executable, **env}
    proc = cluster.run("sbatch", "--parsable", "-o", str(out), *args, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def wait_gone(cluster, job_id, timeout=300):
    deadline = time.monotonic() + timeout
    while job_id in cluster.jobs():
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id)
            pytest.fail(f"job {job_id} still in the queue after {timeout} s")
        time.sleep(0.5)


def exit_code(cluster, job_id) -> str:
    out = cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    return next(f.split("=", 1)[1] for f in out.split() if f.startswith("ExitCode="))


def metrics(exp):
    with open(exp / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_two_rank_job_completes(cluster, tmp_path):
    exp, out = tmp_path / "exp", tmp_path / "job.out"
    job = submit(
        cluster,
        out,
        "--ntasks-per-node=2",
        TRAIN,
        *SFT_DEMO,
        "--exp-dir",
        str(exp),
        "train.max_steps=4",
        TASKS_PER_NODE="2",
    )
    wait_gone(cluster, job)
    log = out.read_text()
    assert exit_code(cluster, job) == "0:0", log[-4000:]
    assert log.strip().splitlines()[-1] == f"metrics: {exp}/metrics.jsonl"
    assert [r["step"] for r in metrics(exp)] == [0, 1, 2, 3]
    assert os.listdir(exp / "checkpoints") == ["step_000004"]


def test_sigterm_checkpoints_and_the_next_job_resumes(cluster, tmp_path):
    exp, out = tmp_path / "exp", tmp_path / "job.out"
    job = submit(cluster, out, TRAIN, *SFT_DEMO, "--exp-dir", str(exp), "train.max_steps=100000")
    try:
        deadline = time.monotonic() + 180
        mfile = exp / "metrics.jsonl"
        while not (mfile.exists() and mfile.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and job in cluster.jobs(), out.read_text()[-4000:]
            time.sleep(0.2)
        assert cluster.run("scancel", "--batch", "--signal=TERM", job).returncode == 0
        wait_gone(cluster, job)
    finally:
        cluster.run("scancel", job)
    log = out.read_text()
    assert exit_code(cluster, job) == "0:0", log[-4000:]
    assert "asking the trainer to checkpoint and stop" in log
    stopped = len(metrics(exp))
    assert os.listdir(exp / "checkpoints") == [f"step_{stopped:06d}"]

    out2 = tmp_path / "job2.out"
    second = submit(cluster, out2, TRAIN, *SFT_DEMO, "--exp-dir", str(exp), f"train.max_steps={stopped + 2}")
    wait_gone(cluster, second)
    log2 = out2.read_text()
    assert exit_code(cluster, second) == "0:0", log2[-4000:]
    assert f"resumed from {exp}/checkpoints/step_{stopped:06d} at step {stopped}" in log2
    assert [r["step"] for r in metrics(exp)] == list(range(stopped + 2))


def test_config_mistake_fails_the_job_naming_the_key(cluster, tmp_path):
    out = tmp_path / "job.out"
    job = submit(cluster, out, TRAIN, *SFT_DEMO, "--exp-dir", str(tmp_path / "exp"), "train.global_batchsize=3")
    wait_gone(cluster, job)
    assert exit_code(cluster, job) != "0:0"
    log = out.read_text()
    assert "train.global_batchsize" in log and "the sft job failed" in log
