"""The three trainers as users run them (scripts/train_{sft,reward_model,dpo}.py with the CPU demo configs): each
demo learns, a resumed run continues exactly, SIGTERM (through launchers/local/train.py) and max_time checkpoint and
exit 0, a config or data mistake is one line and exit 2."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINERS = ("sft", "reward_model", "dpo")


def train(trainer, exp_dir, *overrides, timeout=600):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", f"train_{trainer}.py"),
        "--config-name",
        f"{trainer}_demo",
        f"exp_dir={exp_dir}",
        "logging.progress_bar=false",
        *overrides,
    ]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def metrics(exp_dir):
    with open(os.path.join(exp_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(rows, key):
    values = [r[key] for r in rows]
    return sum(values) / len(values)


def checkpoints(exp_dir):
    return sorted(os.listdir(os.path.join(exp_dir, "checkpoints")))


COMMON = ["step", "train/loss", "train/grad_norm", "train/lr", "train/tokens", "train/tokens_per_s", "timing/step"]


@pytest.mark.parametrize("trainer", TRAINERS)
def test_demo_learns(trainer, tmp_path):
    proc = train(trainer, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == f"metrics: {tmp_path}/metrics.jsonl"
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) >= 40
    for key in COMMON:
        assert all(r.get(key) is not None for r in rows), f"{key} missing from some steps"
    val = [r for r in rows if "val/loss" in r]
    assert len(val) >= 4 and val[-1]["step"] == rows[-1]["step"], "validation every 10 steps and at the end"
    (last_ckpt,) = checkpoints(tmp_path)
    ckpt = tmp_path / "checkpoints" / last_ckpt
    assert last_ckpt == f"step_{len(rows):06d}" and (ckpt / "model.yaml").is_file()
    if trainer == "sft":
        assert val[-1]["val/loss"] < 0.5 * val[0]["val/loss"], [r["val/loss"] for r in val]
        assert rows[-1]["train/padding_fraction"] < 0.5, "packing keeps padding a small part of the compute"
        assert "packed rows: attention kept inside each sample by a block-diagonal mask" in proc.stderr  # CPU
    elif trainer == "reward_model":
        assert val[-1]["val/accuracy"] >= 0.9, [r["val/accuracy"] for r in val]  # chance is 0.5
        assert val[-1]["val/reward_margin"] > 1.0
        for key in ("train/accuracy", "val/loss"):
            assert all(key in r for r in (val if key.startswith("val") else rows))
        stats = json.loads((ckpt / "reward_stats.json").read_text())
        assert stats["count"] == 2 * 256 and stats["reward_std"] > 0
    else:
        assert rows[0]["train/reward_margin"] == 0.0, "policy == reference before the first update"
        assert rows[0]["train/accuracy"] == 0.0
        for key in ("train/rewards_chosen", "train/rewards_rejected", "val/accuracy"):
            assert all(key in r for r in (val if key.startswith("val") else rows))
        assert mean(rows[-5:], "train/reward_margin") > mean(rows[:5], "train/reward_margin") + 0.5
        assert val[-1]["val/reward_margin"] > val[0]["val/reward_margin"] > 0
        assert val[-1]["val/accuracy"] >= 0.9


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/") and k != "train/tokens_per_s"}


@pytest.mark.parametrize("trainer, extra", [("sft", ()), ("reward_model", ()), ("dpo", ("dpo.reference=precomputed",))])
def test_resume_continues_exactly(trainer, extra, tmp_path):
    common = ("train.val_every=2", "checkpoint.save_every=0", "train.global_batch_size=8", "train.micro_batch_size=4")
    common += ("reward_stats.max_examples=8",) if trainer == "reward_model" else ()
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert train(trainer, straight, "train.max_steps=4", *common, *extra).returncode == 0
    first = train(trainer, split, "train.max_steps=2", *common, *extra)
    assert first.returncode == 0, first.stderr[-3000:]
    assert checkpoints(split) == ["step_000002"]
    second = train(trainer, split, "train.max_steps=4", *common, *extra)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stderr
    a, b = metrics(straight), metrics(split)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert [_comparable(r) for r in b] == [_comparable(r) for r in a]


def test_sigterm_through_the_local_launcher_checkpoints_and_exits_0(tmp_path):
    cmd = [
        sys.executable,
        os.path.join(ROOT, "launchers", "local", "train.py"),
        "--trainer",
        "sft",
        f"exp_dir={tmp_path}",
        "logging.progress_bar=false",
        "train.max_steps=100000",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics_file = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (metrics_file.exists() and metrics_file.read_text().count("\n") >= 2):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == f"metrics: {tmp_path}/metrics.jsonl"
    (ckpt,) = checkpoints(tmp_path)
    state = json.loads((tmp_path / "checkpoints" / ckpt / "state.json").read_text())
    assert state["step"] == len(metrics(tmp_path)) < 100000
    assert state["sampler"]["consumed"] == 32 * state["step"]


def test_max_time_checkpoints_and_exits_0(tmp_path):
    proc = train("dpo", tmp_path, "max_time=0.001", "train.max_steps=1000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert checkpoints(tmp_path) == ["step_000001"] and len(metrics(tmp_path)) == 1


def _bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "say a: cat:", "chosen": " aa", "rejected": " bb"}
    path.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "say a:", "chosen": " aa"}) + "\n")
    return path


@pytest.mark.parametrize(
    "overrides, text",
    [
        (["train.global_batchsize=8"], "train.global_batchsize"),
        (["data.train_file=nowhere.jsonl"], "nowhere.jsonl"),
        (["dpo.loss=ipo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing"),
        (["data.bad_rows=error", "data.train_file={bad}"], "bad.jsonl:2: needs a string field 'rejected'"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(overrides, text, tmp_path):
    bad = _bad_rows(tmp_path)
    proc = train("dpo", tmp_path / "x", *[o.format(bad=bad) for o in overrides], timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train_dpo: ") and text in last, last
    assert "Traceback" not in proc.stderr


def test_an_experiment_directory_in_use_is_refused_in_one_line(tmp_path):
    """Two runs writing one experiment directory would interleave checkpoints: the second is refused, exit 2."""
    from aligner.utils.lock import hold

    lock = hold(str(tmp_path), "a run of this test")
    try:
        proc = train("sft", tmp_path, "train.max_steps=1")
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("train_sft: ") and "in use by another run (a run of this test" in last, last
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()
