"""The RL loop with a critic-free estimator, in real gloo processes (the actor job alone: the reward function runs in
the job's own worker processes): DP=2 reproduces one process, also with dynamic sampling; dynamic sampling keeps
the batch size; the KL as a loss term or as a reward penalty; the adaptive KL controller in the units of its target;
several PPO epochs per rollout batch."""

import json
import os

import pytest
from dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Small and quick: 4 prompts x 4 samples, two global mini-batches, responses of up to 2 tokens.
BASE = (
    "ppo.num_steps=2",
    "ppo.rollout_batch_size=4",
    "ppo.n_samples_per_prompt=4",
    "ppo.num_mini_batches=2",
    "ppo.micro_batch_size=4",
    "sampling.max_new_tokens=2",
    "generation.max_batch_size=16",
    "reward.num_workers=1",
    "checkpoint.save_at_end=false",
    "validation.every=0",
    "logging.tensorboard=false",
    "logging.samples_every=0",
    "logging.progress_bar=false",
)
# A reward that varies within groups at random initialisation: 1 when the response holds a digit.
DIGIT_REWARD = (
    "def reward_fn(prompts, responses):\n    return [float(any(c.isdigit() for c in r)) for r in responses]\n"
)


def _train(rank, world, exp_dir, overrides):
    from aligner.config.actor import load_actor_config
    from aligner.parallel import initialize
    from aligner.ppo.trainer import PPOTrainer

    cfg = load_actor_config(["--config-name", "grpo_demo", *BASE, f"exp_dir={exp_dir}", *overrides])
    initialize(cfg.parallel.tensor_model_parallel_size, 1, seed=cfg.seed)
    trainer = PPOTrainer(cfg)
    try:
        path = trainer.fit()
        steps = trainer.policy.steps_taken
    finally:
        trainer.close()
    if path is None:
        return None, steps
    with open(path) as f:
        return [json.loads(line) for line in f], steps


def train(tmp_path, name, world, *overrides):
    results = run_ranks(_train, world, str(tmp_path / name), list(overrides), timeout=600)
    rows, steps = results[0]
    return rows, steps


def _comparable(row):
    return {k: v for k, v in row.items() if not k.startswith("timing/")}


KL_IN_LOSS = ("ppo.kl.placement=loss", "ppo.kl.estimator=k3", "ppo.kl.coef=0.1")
ADAPTIVE = ("ppo.kl.adaptive=true", "ppo.kl.target=0.02", "ppo.kl.horizon=40")


@pytest.fixture(scope="module")
def digit_reward(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "digits.py"
    path.write_text(DIGIT_REWARD)
    return str(path)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, digit_reward):
    tmp = tmp_path_factory.mktemp("one")
    return {
        "loss": train(tmp, "loss", 1, *KL_IN_LOSS, *ADAPTIVE, f"reward.fn={digit_reward}"),
        "dynamic": train(
            tmp,
            "dynamic",
            1,
            "ppo.dynamic_sampling.enabled=true",
            "ppo.dynamic_sampling.max_draws=3",
            "ppo.kl.coef=0.05",
            "ppo.num_steps=4",
            f"reward.fn={digit_reward}",
        ),
    }


@pytest.mark.parametrize("run", ["loss", "dynamic"])
def test_two_ranks_match_one_process(tmp_path, one_process, digit_reward, run):
    """Whole groups per rank, global mini-batches and per-sample seeds: DP=2 draws the same samples, computes the
    same group baselines and takes the same optimizer steps. With dynamic sampling every rank sees every draw and
    keeps the same groups. The engine reads the policy's own tensors (shared weights: fp32 on CPU), so a log-prob
    mismatch at 0 after each update also says generation saw the new weights."""
    overrides = {
        "loss": (*KL_IN_LOSS, *ADAPTIVE),
        "dynamic": (
            "ppo.dynamic_sampling.enabled=true",
            "ppo.dynamic_sampling.max_draws=3",
            "ppo.kl.coef=0.05",
            "ppo.num_steps=4",
        ),
    }[run]
    a, steps_a = one_process[run]
    # ... also when the engine frees its KV cache for scoring and training and takes it back before generating
    b, steps_b = train(tmp_path, run, 2, *overrides, "generation.release_kv_cache=true", f"reward.fn={digit_reward}")
    assert len(a) == len(b) and steps_a == steps_b
    noise = ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error")
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)
        for key, value in _comparable(ra).items():
            if key in noise:
                assert rb[key] < 1e-5, key
            else:
                assert rb[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_tensor_parallel_ranks_share_the_first_ranks_scores(tmp_path, one_process, digit_reward):
    """TP=2: the reward function runs on TP rank 0 alone (one pool per data-parallel slice) and both ranks get its
    scores. The demo's padded vocabulary is the same at TP=1 and TP=2, so the first step matches one process up to
    the rounding of TP reductions."""
    a, _ = one_process["loss"]
    b, _ = train(
        tmp_path, "tp2", 2, *KL_IN_LOSS, *ADAPTIVE, "parallel.tensor_model_parallel_size=2", f"reward.fn={digit_reward}"
    )
    noise = ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error")
    for key, value in _comparable(a[0]).items():
        if key in noise:
            assert b[0][key] < 1e-5, key
        else:
            assert b[0][key] == pytest.approx(value, rel=1e-3, abs=1e-6), key


def test_dynamic_sampling_keeps_the_batch_size(one_process):
    rows, _ = one_process["dynamic"]
    assert all(r["rollout/samples"] == 16 for r in rows), "4 prompts x 4 samples, every step"
    assert all(1 <= r["rollout/draws"] <= 3 for r in rows)
    assert any(r["rollout/drawn_zero_std_group_fraction"] > 0 for r in rows), "nothing was filtered: a vacuous test"
    for r in rows:
        if r["rollout/draws"] < 3:  # filled before the cap: only groups whose rewards differ
            assert r["rollout/zero_std_group_fraction"] == 0.0
        else:  # at the cap: dropped groups fill what is missing, and are counted
            assert r["rollout/zero_std_group_fraction"] <= r["rollout/drawn_zero_std_group_fraction"] + 1e-12


def test_kl_in_the_loss_is_not_in_the_rewards(one_process):
    """KL as a loss term: rewards carry the score alone and the loss reports the k3 term; as a reward penalty:
    every response token pays -beta * k1."""
    loss_rows, _ = one_process["loss"]
    assert loss_rows[0]["ppo/kl"] == 0.0, "policy and reference are identical before the first update"
    assert loss_rows[1]["ppo/kl_loss"] > 0
    for r in loss_rows:
        assert r["rollout/token_reward_mean"] * r["rollout/tokens"] == pytest.approx(
            r["rollout/reward_mean"] * r["rollout/samples"], rel=1e-5, abs=1e-6
        )
    reward_rows, _ = one_process["dynamic"]
    assert all("ppo/kl_loss" not in r for r in reward_rows)
    for r in reward_rows:
        penalty = r["ppo/kl_coef"] * r["ppo/kl"] * r["rollout/tokens"]
        assert r["rollout/token_reward_mean"] * r["rollout/tokens"] == pytest.approx(
            r["rollout/reward_mean"] * r["rollout/samples"] - penalty, rel=1e-5, abs=1e-6
        )
    assert any(r["ppo/kl"] != 0 for r in reward_rows[1:])


def test_adaptive_kl_reads_the_units_of_its_target(one_process):
    """target 0.02 nats per sample (ppo.kl.target_units=sample): each step's beta follows Ziegler et al.'s update
    from the logged per-sample KL (the sum over a response), not from the per-token mean."""
    rows, _ = one_process["loss"]
    for prev, nxt in zip(rows, rows[1:]):
        error = min(max(prev["ppo/kl_per_sample"] / 0.02 - 1, -0.2), 0.2)
        assert nxt["ppo/kl_coef"] == pytest.approx(prev["ppo/kl_coef"] * (1 + error * 16 / 40), rel=1e-9)
    assert rows[0]["ppo/kl_coef"] == 0.1


def test_several_epochs_per_rollout_batch(tmp_path, digit_reward):
    """ppo.epochs=2: twice the optimizer steps, and the second pass is off-policy (ratios move away from 1); with
    one epoch of one mini-batch the update is on-policy (ratio 1 up to float rounding)."""
    rows, steps = train(tmp_path, "epochs", 1, "ppo.epochs=2", "ppo.num_mini_batches=1", f"reward.fn={digit_reward}")
    assert steps == 2 * 2 * 1
    assert rows[0]["ppo/ratio_max"] > 1.001 and rows[0]["ppo/clipfrac"] >= 0
    one, steps = train(tmp_path, "epoch", 1, "ppo.num_mini_batches=1", f"reward.fn={digit_reward}")
    assert steps == 2
    assert one[0]["ppo/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    # grpo_demo's KL: a reward term with coefficient 0, so the update's own log-probs serve; no KL loss is reported
    assert one[0]["ppo/update_logprobs_reused"] == 1.0 and "ppo/kl_loss" not in one[0] and one[0]["ppo/kl"] == 0.0
    assert "ppo/rollout_weight_mean" not in one[0]  # ppo.rollout_correction_cap is off by default


def test_micro_batches_cut_to_their_longest_row_train_the_same(tmp_path, digit_reward):
    """ppo.trim_padding: rows sorted by length into micro-batches, each cut to its longest row (here to the token:
    the demo's sequences are shorter than the default 64). The same log-probs, losses and steps as micro-batches of
    the step's width with the rows sorted (the default 64 leaves these widths whole) or in rollout order (0), with
    less padding computed. Prompts of several lengths (the PPO demo's)."""
    args = (*KL_IN_LOSS, f"reward.fn={digit_reward}", "data.train_file=conf/demo/prompts_train.jsonl")
    runs = {trim: train(tmp_path, f"trim{trim}", 1, *args, f"ppo.trim_padding={trim}")[0] for trim in (64, 1, 0)}
    whole, cut, in_order = runs[64], runs[1], runs[0]
    assert len(whole) == len(cut) == len(in_order) == 2
    for a, b, c in zip(whole, cut, in_order):
        assert set(a) == set(b) == set(c)
        assert b["ppo/padding_fraction"] < a["ppo/padding_fraction"] == c["ppo/padding_fraction"]
        for key, value in _comparable(a).items():
            if key in ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error"):
                assert b[key] < 1e-5 and c[key] < 1e-5, key
            elif key != "ppo/padding_fraction":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
                assert c[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert whole[1]["ppo/kl"] > 0, "the policy moved: a vacuous comparison"


def test_micro_batches_by_tokens_train_the_same(tmp_path, one_process, digit_reward):
    """ppo.micro_batch_tokens: each micro-batch holds as many rows as fit in the budget at its width (DP ranks whose
    rows differ in length then run different numbers of micro-batches: test_model_parallel.py holds that case for the
    model alone). DP=2 by tokens, cut to the token, takes one process's optimizer steps by rows."""
    a, steps_a = one_process["loss"]
    by_tokens = ("ppo.micro_batch_tokens=30", "ppo.trim_padding=1", "ppo.micro_batch_size=1")  # by rows: 8 a step
    b, steps_b = train(tmp_path, "tokens", 2, *KL_IN_LOSS, *ADAPTIVE, *by_tokens, f"reward.fn={digit_reward}")
    assert len(a) == len(b) and steps_a == steps_b
    assert {r["ppo/micro_batches"] for r in a} == {2.0}  # 8 rows an optimizer step in micro-batches of 4 rows
    # a rank's 4 rows of a mini-batch, two to a micro-batch (two demo rows fit in 30 tokens): 2 ranks x 2
    assert {r["ppo/micro_batches"] for r in b} == {4.0}
    for ra, rb in zip(a, b):
        assert set(ra) == set(rb)
        for key, value in _comparable(ra).items():
            if key in ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error"):
                assert rb[key] < 1e-5, key
            elif key != "ppo/micro_batches":
                assert rb[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_update_logprobs_replace_the_policy_pass(tmp_path, one_process, digit_reward):
    """One epoch of one mini-batch with the KL in the loss (issue 17): the update's own forward gives the old
    log-probs and the separate policy pass is skipped. Same training as with that pass (the ratio is 1 either way),
    the KL at step 0 is exactly 0 (the reference runs on the update's micro-batches), and the rollout's KL and
    mismatch are still reported. Several mini-batches keep the pass."""
    args = ("ppo.num_mini_batches=1", "ppo.num_steps=3", *KL_IN_LOSS, f"reward.fn={digit_reward}")
    reused, _ = train(tmp_path, "reused", 1, *args)
    separate, _ = train(tmp_path, "separate", 1, *args, "ppo.reuse_update_logprobs=false")
    assert [r["ppo/update_logprobs_reused"] for r in reused] == [1.0] * 3
    assert [r["ppo/update_logprobs_reused"] for r in separate] == [0.0] * 3
    assert reused[0]["ppo/kl"] == 0.0 and reused[0]["ppo/kl_k3"] == 0.0
    assert reused[2]["ppo/kl"] != 0.0 and reused[2]["ppo/kl_loss"] > 0, "the policy moved: a vacuous comparison"
    for a, b in zip(reused, separate):
        assert set(a) == set(b)
        for key, value in _comparable(a).items():
            if key in ("ppo/logprob_mismatch", "ppo/logprob_mismatch_max", "ppo/ratio_error"):
                assert value < 1e-5 and b[key] < 1e-5, key
            elif key != "ppo/update_logprobs_reused":
                assert b[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    several, _ = one_process["loss"]  # BASE: two mini-batches
    assert [r["ppo/update_logprobs_reused"] for r in several] == [0.0] * len(several)


def test_fp8_rollouts_with_the_rollout_correction(tmp_path, digit_reward):
    """generation.decode_weights=fp8 draws tokens off the trained (float32 on CPU) policy: the mismatch shows, and
    ppo.rollout_correction_cap weights the policy gradient by the capped probability ratio (not 1, within the cap)."""
    cap = 1.5
    args = ("ppo.num_mini_batches=1", "generation.decode_weights=fp8", f"reward.fn={digit_reward}")
    rows, _ = train(tmp_path, "tis", 1, *args, f"ppo.rollout_correction_cap={cap}")
    for row in rows:
        assert row["ppo/logprob_mismatch"] > 1e-3, "FP8 rollouts must differ from the trained policy"
        assert 0 < row["ppo/rollout_weight_max"] <= cap and abs(row["ppo/rollout_weight_mean"] - 1) > 1e-4


def test_actor_alone_commits_and_resumes_its_checkpoints(tmp_path, digit_reward):
    """No critic job (the reward function runs in the actor): the run's commit record (aligner.checkpoint.run) covers
    the actor's checkpoints alone, and a restart resumes from the newest committed step without asking any critic."""
    from aligner.checkpoint import dist_ckpt, run

    save = ("checkpoint.save_every=1", "checkpoint.save_at_end=true", f"reward.fn={digit_reward}")
    rows, _ = train(tmp_path, "ckpt", 1, *save)
    root = tmp_path / "ckpt" / "checkpoints"
    first = run.read(str(root))
    assert first is not None and first.steps == [1, 2] and [r["step"] for r in rows] == [0, 1]
    assert dist_ckpt.read_state(str(root / dist_ckpt.step_dir_name(2)))["run_id"] == first.run_id
    rows, _ = train(tmp_path, "ckpt", 1, *save, "ppo.num_steps=3")  # the same directory: resumes at step 2
    assert [r["step"] for r in rows] == [0, 1, 2]  # metrics.jsonl continued from the resume point
    again = run.read(str(root))
    assert again.run_id == first.run_id and again.steps == [2, 3]  # checkpoint.keep=2
