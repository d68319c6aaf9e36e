"""The two jobs as real processes (launchers/local/ppo.py): the CPU demo learns, resumes exactly, stops cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from ppo_jobs import LAUNCHER, ROOT, launch, read_metrics
from ppo_jobs import comparable as _comparable

ACTOR = os.path.join(ROOT, "scripts", "train_ppo_actor.py")
REQUIRED = [
    "step",
    "rollout/reward_mean",
    "rollout/response_length_mean",
    "rollout/ended_fraction",
    "ppo/kl",
    "ppo/kl_coef",
    "ppo/policy_loss",
    "ppo/clipfrac",
    "ppo/entropy",
    "ppo/grad_norm",
    "ppo/logprob_mismatch",
    "critic/value_loss",
    "critic/explained_var",
    "timing/generate",
    "timing/logprobs",
    "timing/critic_wait",
    "timing/train",
    "timing/refit",
    "timing/step",
]


def _no_stray_processes(marker):
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_demo_learns(tmp_path):
    """The demo learns, with the reference kept by swapping its weights into the policy's model (reference.mode=swap:
    the default keeps a copy, which every other launch here runs): KL 0 before the first update, not after it."""
    proc = launch(tmp_path, "ppo.num_steps=20", "validation.every=10", "reference.mode=swap")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"metrics: {tmp_path}/actor/metrics.jsonl"
    assert "the jobs share the CPU: they take turns (critic.overlap=false)" in proc.stdout
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(20))
    for key in REQUIRED:
        assert all(r.get(key) is not None for r in rows), f"{key} missing from some steps"
    assert rows[0]["ppo/kl"] == 0.0, "policy and reference must be identical before the first update"
    assert rows[1]["ppo/kl"] != 0.0, "the reference stays where the policy started"
    assert max(r["ppo/logprob_mismatch"] for r in rows) < 1e-4, "engine and training log-probs must agree"
    first = sum(r["rollout/reward_mean"] for r in rows[:5]) / 5
    last = sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5
    assert last > first + 0.05, f"reward did not rise: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    assert any("val/reward_mean" in r for r in rows)
    with open(tmp_path / "actor" / "samples.jsonl") as f:
        sample = json.loads(f.readline())
    assert {"step", "prompt", "response", "reward", "ended"} <= set(sample)
    assert os.path.isdir(tmp_path / "actor" / "tensorboard")
    assert not _no_stray_processes(str(tmp_path))


def step_dirs(path):
    return sorted(n for n in os.listdir(path) if n.startswith("step_"))


def test_resume_continues_exactly_and_never_pairs_an_uncommitted_critic_step(tmp_path):
    """Resume is exact; and when the actor dies after the critic saved a step but before the step was committed
    (here: the actor cannot write its own checkpoint), the next run resumes both jobs from the last committed step:
    the critic's orphan step is removed, never paired with an older actor state (issue 14). The uninterrupted run
    waits for the critic's answers before its own work (critic.overlap=false, what the launcher picks on the CPU),
    the resumed one does not (true): the order changes no number."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("checkpoint.save_every=0", "validation.every=0")
    # one run at a time: two critic and actor pairs at once starved a Triton python stub on CI's two cores (its
    # health check failed: "Stub process ... is not healthy")
    done = launch(straight, "ppo.num_steps=4", "critic.overlap=false", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    common_split = (*common, "critic.overlap=true")
    first = launch(split, "ppo.num_steps=2", *common_split)
    assert first.returncode == 0, first.stderr[-3000:]
    assert step_dirs(split / "actor" / "checkpoints") == ["step_000002"]
    blocker = split / "actor" / "checkpoints" / ".tmp-step_000003"
    blocker.write_text("a file where the actor's checkpoint directory must go")
    broken = launch(split, "ppo.num_steps=4", "checkpoint.save_every=1", "validation.every=0")
    assert broken.returncode != 0
    assert step_dirs(split / "critic" / "checkpoints") == ["step_000002", "step_000003"]  # the critic saved 3
    assert json.loads((split / "actor" / "checkpoints" / "committed.json").read_text())["steps"] == [2]
    blocker.unlink()
    second = launch(split, "ppo.num_steps=4", *common_split)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "removing" in (split / "critic.log").read_text()  # the orphan step 3 of the critic
    a, b = read_metrics(straight), read_metrics(split)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    for ra, rb in zip(a[2:], b[2:]):
        assert _comparable(ra) == _comparable(rb)


def test_sigterm_checkpoints_and_leaves_nothing(tmp_path):
    cmd = [
        sys.executable,
        LAUNCHER,
        "--exp-dir",
        str(tmp_path),
        "--actor",
        "logging.progress_bar=false",
        "ppo.num_steps=200",
        "checkpoint.save_every=0",
        "validation.every=0",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "actor" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    ckpts = step_dirs(tmp_path / "actor" / "checkpoints")
    assert len(ckpts) == 1, ckpts
    state = json.loads((tmp_path / "actor" / "checkpoints" / ckpts[0] / "state.json").read_text())
    assert state["step"] == len(read_metrics(tmp_path)) < 200
    assert step_dirs(tmp_path / "critic" / "checkpoints") == ckpts, "the critic checkpoints at the same step"
    time.sleep(1)
    assert not _no_stray_processes(str(tmp_path))


def _actor(*overrides, timeout=300):
    return subprocess.run(
        [sys.executable, ACTOR, "--config-name", "ppo_actor_demo", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_config_names_the_key(tmp_path):
    proc = _actor(f"exp_dir={tmp_path}/x", "ppo.rollout_batchsize=8")
    assert proc.returncode == 2 and "ppo.rollout_batchsize" in proc.stderr
    proc = _actor(f"exp_dir={tmp_path}/x", "ppo.micro_batch_size=5")
    assert proc.returncode != 0 and "ppo.micro_batch_size" in proc.stderr
    proc = _actor(f"exp_dir={tmp_path}/x", "data.train_file=nowhere.jsonl")
    assert proc.returncode == 2 and "data.train_file" in proc.stderr and "nowhere.jsonl" in proc.stderr
    assert not os.path.exists(tmp_path / "x"), "nothing is written for a config that fails validation"


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["optim.lr=nan"], "optim.lr"),
        (["optim.lr=-1"], "optim.lr"),
        (["sampling.top_p=1.5"], "sampling.top_p"),
        (["sampling.top_p=0"], "sampling.top_p"),
        (["sampling.top_k=-5"], "sampling.top_k"),
        (["parallel.tensor_model_parallel_size=2"], "launch a multiple of 2 ranks"),  # one process here
        (["data.train_file={bad_json}"], "not valid JSON"),
        (["data.train_file={empty}"], "no usable prompts"),
        (["data.train_file={no_key}"], "needs a string 'prompt' (data.prompt_key) or a list 'messages'"),
        (["data.train_file={tmp}"], "is a directory"),
        (["data.train_file={not_utf8}"], "is not UTF-8"),
    ],
)
def test_user_mistakes_are_one_line_and_exit_2(tmp_path, overrides, words):
    files = {
        "bad_json": '{"prompt": "a"}\n{"prompt": \n',
        "empty": "\n",
        "no_key": '{"text": "a"}\n',
    }
    paths = {name: tmp_path / f"{name}.jsonl" for name in files}
    for name, text in files.items():
        paths[name].write_text(text)
    paths["not_utf8"] = tmp_path / "latin1.jsonl"
    paths["not_utf8"].write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    args = [o.format(tmp=tmp_path, **paths) for o in overrides]
    proc = _actor(f"exp_dir={tmp_path}/x", *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_unreachable_critic_is_explained(tmp_path):
    from dist import free_port

    port = free_port()
    proc = _actor(f"exp_dir={tmp_path}/x", f"critic.port={port}", "critic.connect_timeout=3")
    assert proc.returncode != 0
    assert f"127.0.0.1:{port}" in proc.stderr and "critic" in proc.stderr
    assert not os.path.exists(tmp_path / "x" / "metrics.jsonl")


def test_critic_warmup_then_max_time(tmp_path):
    """During critic warm-up only the critic trains (the policy stays the reference: KL stays exactly 0);
    max_time stops the run cleanly with a checkpoint."""
    proc = launch(tmp_path, "ppo.num_steps=50", "ppo.critic_warmup_steps=2", "max_time=0.001", "validation.every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert len(rows) == 1, "max_time stops after the step in progress"
    assert "ppo/policy_loss" not in rows[0] and rows[0]["critic/value_loss"] is not None
    assert step_dirs(tmp_path / "actor" / "checkpoints") == ["step_000001"]
    resumed = launch(tmp_path, "ppo.num_steps=3", "ppo.critic_warmup_steps=2", "validation.every=0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[1]["ppo/kl"] == 0.0 and "ppo/policy_loss" not in rows[1], "still warming up the critic"
    assert rows[2]["ppo/kl"] == 0.0 and "ppo/policy_loss" in rows[2], "first policy update on the last step"


def test_one_launcher_per_experiment_directory(tmp_path):
    """A second run on a directory in use stops at once, naming the holder; a holder that was killed does not leave
    the directory locked (issue 14)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from aligner.utils.lock import hold; "
            f"hold({str(tmp_path)!r}, 'a test holder'); print('held', flush=True); time.sleep(600)",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = launch(tmp_path, "ppo.num_steps=1", timeout=120)
        assert proc.returncode == 2 and "is in use by another run (a test holder, pid" in proc.stderr, proc.stderr
        assert not (tmp_path / "critic.log").exists(), "nothing was started"
    finally:
        holder.kill()
        holder.wait()
    from aligner.utils.lock import hold

    hold(str(tmp_path), "after the holder died").release()


def test_killed_launcher_leaves_no_job_behind(tmp_path):
    """SIGKILL of the launcher (no chance to clean up): both jobs and tritonserver still end (issue 14)."""
    import psutil

    cmd = [
        sys.executable,
        LAUNCHER,
        "--exp-dir",
        str(tmp_path),
        "--actor",
        "logging.progress_bar=false",
        "ppo.num_steps=1000",
        "checkpoint.save_every=0",
        "validation.every=0",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "actor" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 1):
        assert proc.poll() is None
        time.sleep(0.5)
    jobs = psutil.Process(proc.pid).children(recursive=True)
    assert any("tritonserver" in " ".join(p.cmdline()) for p in jobs if p.is_running())
    proc.kill()
    proc.wait()
    gone, alive = psutil.wait_procs(jobs, timeout=120)
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    assert not _no_stray_processes(str(tmp_path))
