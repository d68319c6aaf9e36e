"""The actor job at DP=2, TP=2 and PP=2 against one process (the two jobs as real processes, the CPU demo)."""

import subprocess
import sys

import pytest
from ppo_jobs import LAUNCHER, ROOT, comparable, finish, launch, launch_in_background, read_metrics


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    exp = tmp_path_factory.mktemp("one")
    proc = launch(exp, *PARITY_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(exp)


# ppo.trim_padding=0: rows in rollout order. Sorted by length (the default), each DP rank orders its own rows, so
# the micro-batches' gradients are summed in another order than in one process: float noise that flips a discrete
# metric here (critic/value_clipfrac at step 2). Trimming's own equivalence, also at DP=2: test_grpo_trainer.py.
PARITY_ARGS = ("ppo.num_steps=2", "checkpoint.save_at_end=false", "validation.every=0", "ppo.trim_padding=0")


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_actor_ranks_match_one_process(tmp_path, one_process_run, layout):
    """DP=2: the same prompts per global mini-batch and per-sample seeds, global-token loss normalisation and
    whitening over the DP group reproduce the one-process run to float precision, step after step.
    TP=2: the demo's padded vocabulary is the same at TP=1 and TP=2, so the random initial weights are too; the
    first step matches up to the float rounding of TP reductions (later steps may part where a sample's draw sits on
    a CDF boundary)."""
    extra = ["parallel.tensor_model_parallel_size=2"] if layout == "tp2" else []
    cmd = [
        sys.executable,
        LAUNCHER,
        "--exp-dir",
        str(tmp_path),
        "--actor-procs",
        "2",
        "--actor",
        "logging.progress_bar=false",
        *PARITY_ARGS,
        *extra,
    ]
    two = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = one_process_run, read_metrics(tmp_path)
    assert len(a) == len(b) == 2
    steps = 2 if layout == "dp2" else 1
    noise = ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error")  # ~1e-7 either way
    for ra, rb in zip(a[:steps], b[:steps]):
        for key, value in comparable(ra).items():
            if key in noise:
                assert rb[key] < 1e-5, key
            else:
                assert rb[key] == pytest.approx(value, rel=1e-4 if layout == "dp2" else 1e-3, abs=1e-6), key


def _demo_policy_checkpoint(rank, world, root):
    """The demo policy's shape with seeded random weights, as a dist checkpoint (one process)."""
    from aligner.checkpoint import dist_ckpt
    from aligner.config.actor import ActorJobConfig
    from aligner.config.loader import load_config
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    cfg = load_config(ActorJobConfig, "ppo_actor_demo")
    initialize(1, 1, seed=5)
    return dist_ckpt.save(root, 0, [build_gpt(cfg.model)], model_cfg=cfg.model)


def test_pipeline_parallel_actor_matches_one_process(tmp_path):
    """PP=2 (the engine gathers both stages' layers on each rank; log-probs and loss statistics come from the last
    stage) against one process from the same checkpoint: random initialisation differs between layouts (each stage
    draws its layers from the same seed), a checkpoint does not. Float32 arithmetic is the same on both sides, so
    two steps agree to float precision."""
    from dist import run_ranks

    (ckpt,) = run_ranks(_demo_policy_checkpoint, 1, str(tmp_path / "init"))
    args = (*PARITY_ARGS, f"model.checkpoint={ckpt}")
    pp1 = launch_in_background(tmp_path / "pp1", *args)
    pp2 = launch(
        tmp_path / "pp2", *args, "parallel.pipeline_model_parallel_size=2", launcher_args=("--actor-procs", "2")
    )
    assert pp2.returncode == 0, pp2.stderr[-3000:]
    done = finish(pp1)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = read_metrics(tmp_path / "pp1"), read_metrics(tmp_path / "pp2")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key, value in comparable(ra).items():
            if key in ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error"):
                assert rb[key] < 1e-5, key
            else:
                assert rb[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
