"""Critic-free RL as real processes: the GRPO demo (bash launchers/local/grpo.sh) learns; each GRPO/RLOO recipe runs
(a smoke test of the recipe's name); the critic job in reward-only mode scores for GRPO; a failing reward function
stops the job with exit 2, naming the function and the sample, on every rank; no process is left behind."""

import gzip
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO_SH = os.path.join(ROOT, "launchers", "local", "grpo.sh")
LAUNCHER = os.path.join(ROOT, "launchers", "local", "ppo.py")
ACTOR = os.path.join(ROOT, "scripts", "train_ppo_actor.py")
MARKER = "ALIGNER_TEST_GRPO_RUN"  # set in each run's environment: its processes (reward workers too) carry it
REQUIRED = [
    "step",
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/response_length_mean",
    "rollout/zero_std_group_fraction",
    "rollout/samples",
    "ppo/kl",
    "ppo/policy_loss",
    "ppo/clipfrac",
    "ppo/entropy",
    "ppo/grad_norm",
    "ppo/logprob_mismatch",
    "timing/generate",
    "timing/step",
]
# The ~1B recipes at the CPU demo's size: their algorithm settings on the tiny model and the plus-one prompts.
TINY = (
    "model=tiny",
    "model.vocab_size=48",
    "model.make_vocab_size_divisible_by=32",
    "model.max_position_embeddings=128",
    "model.tokenizer=conf/demo/tokenizer.json",
    "data.train_file=conf/demo/plus_one.jsonl",
    "generation.max_prompt_length=32",
    "generation.max_response_length=16",
    "generation.max_batch_size=64",
    "ppo.rollout_batch_size=4",
    "ppo.micro_batch_size=16",
    "reward.num_workers=1",
    "ppo.num_steps=2",
    "checkpoint.save_at_end=false",
    "validation.every=0",
    "logging.progress_bar=false",
)


def _env(marker):
    env = {**os.environ, "PYTHON": sys.executable, MARKER: marker}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def run(cmd, marker, timeout=900):
    return subprocess.run(cmd, cwd=ROOT, env=_env(marker), capture_output=True, text=True, timeout=timeout)


def read_metrics(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def left_behind(marker, grace: float = 5.0):
    """Processes whose environment carries this run's marker still alive `grace` s after the run ended."""
    deadline = time.monotonic() + grace
    while True:
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if f"{MARKER}={marker}".encode() in f.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_grpo_demo_learns(tmp_path):
    """The CPU demo: from near chance (a 1-in-48 guess of the answer token) to a reward of at least 0.8."""
    proc = run(["bash", GRPO_SH, "--exp-dir", str(tmp_path), "--actor", "logging.progress_bar=false"], str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"metrics: {tmp_path}/actor/metrics.jsonl"
    rows = read_metrics(tmp_path / "actor" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(60))
    for key in REQUIRED:
        assert all(r.get(key) is not None for r in rows), f"{key} missing from some steps"
    assert all(r["rollout/samples"] == 16 * 16 for r in rows)
    assert rows[0]["ppo/kl"] == 0.0, "policy and reference are identical before the first update"
    assert max(r["ppo/logprob_mismatch"] for r in rows) < 1e-4, "engine and training log-probs must agree"
    assert rows[0]["rollout/reward_mean"] < 0.1, f"not near chance at the start: {rows[0]['rollout/reward_mean']}"
    last = sum(r["rollout/reward_mean"] for r in rows[-5:]) / 5
    assert last >= 0.8, f"the reward reached {last:.3f} over the last 5 steps, not 0.8"
    assert any("val/reward_mean" in r for r in rows)
    assert not any(k.startswith("critic/") or k == "timing/critic_wait" for r in rows for k in r), "no critic"
    assert not left_behind(str(tmp_path))


@pytest.mark.parametrize("recipe", ["grpo_math", "rloo_math", "grpo_dapo_math", "rloo_demo"])
def test_recipe_smoke(tmp_path, recipe):
    """Each recipe's settings, two steps on the tiny model, the actor job alone. grpo_dapo_math: the strict math
    checker gives every group the same reward, so dynamic sampling draws up to its cap and fills the batch."""
    extra = list(TINY) if recipe != "rloo_demo" else ["ppo.num_steps=2", "logging.progress_bar=false"]
    if recipe == "rloo_demo":  # and the second step under the profiler (logging.profile_step)
        extra += ["logging.profile_step=1"]
    if recipe == "grpo_dapo_math":
        extra += ["ppo.overlong.buffer=4"]
    cmd = [
        sys.executable,
        LAUNCHER,
        "--actor-only",
        "--actor-config",
        recipe,
        "--exp-dir",
        str(tmp_path),
        "--actor",
        *extra,
    ]
    proc = run(cmd, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "actor" / "metrics.jsonl")
    assert len(rows) == 2 and all(r.get(k) is not None for r in rows for k in REQUIRED)
    if recipe == "grpo_dapo_math":
        assert all(r["rollout/draws"] == 3 and r["rollout/samples"] == 4 * 16 for r in rows)
        assert all("rollout/overlong_penalty_mean" in r for r in rows)
    if recipe == "grpo_math":
        assert "ppo/kl_loss" in rows[0], "KL as a loss term"
    profiled = sorted(os.listdir(tmp_path / "actor" / "profile")) if recipe == "rloo_demo" else []
    if recipe == "rloo_demo":
        assert profiled == ["step1-rank0.json.gz", "step1-rank0.summary.json"], profiled
        with open(tmp_path / "actor" / "profile" / "step1-rank0.summary.json") as f:
            phases = json.load(f)["phases"]
        assert {"step", "generate", "logprobs", "train", "refit"} <= set(phases), phases
        assert phases["step"]["wall_ms"] >= phases["generate"]["wall_ms"] + phases["train"]["wall_ms"] > 0
        with gzip.open(tmp_path / "actor" / "profile" / "step1-rank0.json.gz", "rt") as f:
            assert "phase/train" in f.read(), "the phases are named ranges in the trace"
    assert not left_behind(str(tmp_path))


def test_grpo_rm_demo_scored_by_reward_only_critic(tmp_path):
    """grpo_rm_demo + reward_critic_demo: the critic job serves critic_infer alone (no value model), the actor never
    trains or checkpoints it."""
    cmd = [
        sys.executable,
        LAUNCHER,
        "--actor-config",
        "grpo_rm_demo",
        "--critic-config",
        "reward_critic_demo",
        "--exp-dir",
        str(tmp_path),
        "--actor",
        "ppo.num_steps=3",
        "logging.progress_bar=false",
    ]
    proc = run(cmd, str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (tmp_path / "critic.log").read_text()
    assert "(endpoints critic_infer;" in log, log[-2000:]
    rows = read_metrics(tmp_path / "actor" / "metrics.jsonl")
    assert len(rows) == 3 and all(r.get(k) is not None for r in rows for k in REQUIRED)
    # The critic job's wait keeps its name in reward-only mode (no critic_train: critic_wait is the infer wait alone).
    assert all(r["timing/critic_wait"] == r["timing/critic_wait_infer"] for r in rows), rows[0]
    assert not any(k.startswith("critic/") or k in ("timing/critic_wait_train", "timing/reward_wait") for k in rows[0])
    assert os.path.isdir(tmp_path / "actor" / "checkpoints") and not os.path.exists(tmp_path / "critic" / "checkpoints")
    from aligner.checkpoint import run as run_record  # torch: imported here, not by the whole module

    # No critic_save/critic_resume reached the reward-only critic (it binds neither), yet the actor committed its step.
    assert run_record.read(str(tmp_path / "actor" / "checkpoints")).steps == [3]
    assert not left_behind(str(tmp_path))


FAILING = """
import time

def reward_fn(prompts, responses):
    if any(p.startswith("4 plus") for p in prompts):
        raise ValueError("cannot judge this one")
    return [0.0] * len(prompts)

def hangs(prompts, responses):
    if any(p.startswith("4 plus") for p in prompts):
        time.sleep(600)
    return [0.0] * len(prompts)
"""


def _named(err, spec):
    assert f"reward function {spec} failed on sample" in err and "(prompt '4 plus 1:', response" in err, err[-3000:]
    assert "Traceback (most recent call last):\n  File" not in err.split("reward function")[0], "no aligner traceback"


def test_failing_reward_function_stops_every_rank(tmp_path):
    """Two actor ranks: only the rank holding "4 plus 1:" sees the function raise; both stop at that call (no
    hang; torchrun reports the failure), and the message names the function, the sample and the exception, with
    the function's traceback."""
    fn = tmp_path / "judge.py"
    fn.write_text(FAILING)
    cmd = [
        sys.executable,
        LAUNCHER,
        "--actor-only",
        "--actor-procs",
        "2",
        "--actor-config",
        "grpo_demo",
        "--exp-dir",
        str(tmp_path / "run"),
        "--actor",
        f"reward.fn={fn}",
        "ppo.num_steps=2",
        "logging.progress_bar=false",
    ]
    proc = run(cmd, str(tmp_path))
    assert proc.returncode != 0, proc.stdout[-3000:]
    _named(proc.stderr, f"{fn}:reward_fn")
    assert "raised ValueError: cannot judge this one" in proc.stderr and 'raise ValueError("cannot judge' in proc.stderr
    assert not left_behind(str(tmp_path))


def test_hanging_reward_function_is_killed_and_named(tmp_path):
    """One process: the call that does not return within reward.timeout is killed; exit 2 with one line naming the
    function and the sample."""
    fn = tmp_path / "judge.py"
    fn.write_text(FAILING)
    cmd = [
        sys.executable,
        ACTOR,
        "--config-name",
        "grpo_demo",
        f"exp_dir={tmp_path / 'run'}",
        f"reward.fn={fn}:hangs",
        "reward.timeout=3",
        "ppo.num_steps=2",
        "logging.progress_bar=false",
    ]
    proc = run(cmd, str(tmp_path))
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    _named(proc.stderr, f"{fn}:hangs")
    assert "no answer within reward.timeout=3 s" in proc.stderr
    assert not left_behind(str(tmp_path))
