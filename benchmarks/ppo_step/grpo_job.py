"""The GRPO step (issue 16; scripts/bench_ppo_step.py --mode grpo): the actor job alone, through
launchers/local/ppo.py --actor-only, on conf/bench/grpo_step_actor[_tiny].yaml.

`run(...)` writes the same synthetic assets as the PPO mode (aligner_jobs: a WordLevel tokenizer, prompts of exactly
prompt_len tokens with BOS), checks with `check_config` that the config describes the workload (GRPO, the group
size, KL as a loss term with the reference resident, one optimizer step per rollout batch; a difference raises
aligner_jobs.WorkloadMismatch naming the key), runs the steps and reads `timing/*` from metrics.jsonl. The reward is
benchmarks/ppo_step/bench_reward.py (cheap, deterministic, different within each group). Checks recorded: the KL at
step 0 (exactly 0: the reference is a copy of the policy), the largest log-prob mismatch between engine and
training, the response lengths (EOS ignored). This process never initialises CUDA itself.
"""

from __future__ import annotations

import os
import sys

from benchmarks.ppo_step.aligner_jobs import (
    LAUNCHER,
    WorkloadMismatch,
    _device_name,
    _model_shape,
    _version,
    _visible_gpus,
    launch,
    profile_overrides,
    read_metrics,
    split_profiled,
    write_prompts,
    write_tokenizer,
)
from benchmarks.ppo_step.workload import MODEL_KEYS, Workload, gpus_used, result

KL_COEF = 0.04


def check_config(w: Workload, actor_argv: list[str]) -> Workload:
    """Load the actor config as the job will and compare it with `w`; returns `w` with the engine's gen_batch."""
    from aligner.config.actor import load_actor_config

    cfg = load_actor_config(actor_argv)
    p = cfg.ppo
    want = {f"model.{k if k != 'dtype' else 'params_dtype'}": getattr(w, k) for k in MODEL_KEYS}
    got = dict(_model_shape(cfg.model, "model"))
    pairs = {
        "ppo.advantage_estimator": (p.advantage_estimator, "grpo"),
        "ppo.rollout_batch_size": (p.rollout_batch_size, w.prompts),
        "ppo.n_samples_per_prompt": (p.n_samples_per_prompt, w.samples_per_prompt),
        "generation.max_prompt_length": (cfg.generation.max_prompt_length, w.prompt_len),
        "generation.max_response_length": (cfg.generation.max_response_length, w.response_len),
        "sampling.max_new_tokens": (cfg.max_new_tokens, w.response_len),
        "sampling.ignore_eos": (cfg.sampling.ignore_eos, True),
        "ppo.num_mini_batches": (p.num_mini_batches, w.num_mini_batches),
        "ppo.epochs": (p.epochs, w.epochs),
        "ppo.kl.placement": (p.kl.placement, "loss"),
        "ppo.kl.coef": (p.kl.coef, KL_COEF),
        "ppo.kl.adaptive": (p.kl.adaptive, False),
        "ppo.dynamic_sampling.enabled": (p.dynamic_sampling.enabled, False),
        "reference.mode": (cfg.reference.mode, "resident"),
        "reward.source": (cfg.reward.source, "function"),
    }
    for key, (value, wanted) in pairs.items():
        got[key], want[key] = value, wanted
    for key, value in want.items():
        if got[key] != value:
            raise WorkloadMismatch(key, f"is {got[key]!r} but the GRPO benchmark workload uses {value!r}")
    return w.with_(gen_batch=min(cfg.generation.max_batch_size, w.rollouts))


def run(
    w: Workload,
    steps: int,
    warmup: int,
    actor_config: str,
    exp_dir: str,
    actor_overrides=(),
    timeout_s: float = 480.0,
    actor_gpus: str | None = None,
    profile: bool = False,
    model_overrides=(),
    hf_config: str | None = None,
) -> dict:
    """Run the actor job for `steps` GRPO steps in a fresh `exp_dir`; the result record (workload.result).
    `profile`: one more step under the profiler, outside the means (aligner_jobs.split_profiled).
    `model_overrides`: the model section's shape (benchmarks.shapes.shape_overrides of the Hugging Face config
    `hf_config`, which the record names), before `actor_overrides`; `w` must have that shape (Workload.shaped_as)."""
    if os.path.exists(exp_dir) and os.listdir(exp_dir):
        raise FileExistsError(f"{exp_dir} is not empty: give a new --exp-dir (a run never resumes an old one)")
    os.makedirs(exp_dir, exist_ok=True)
    tokenizer, prompts = os.path.join(exp_dir, "tokenizer.json"), os.path.join(exp_dir, "prompts.jsonl")
    write_tokenizer(tokenizer, w.vocab_size)
    write_prompts(prompts, w.prompts, w.prompt_len - 1, w.vocab_size)
    actor_ovr = [*profile_overrides(steps, profile), f"data.train_file={prompts}", f"model.tokenizer={tokenizer}"]
    actor_ovr += [*model_overrides, *actor_overrides]
    w = check_config(w, ["--config-name", actor_config, *actor_ovr])

    cmd = [sys.executable, LAUNCHER, "--actor-only", "--actor-config", actor_config, "--exp-dir", exp_dir]
    if actor_gpus is not None:
        cmd += ["--actor-gpus", actor_gpus]
    cmd += ["--actor", *actor_ovr]
    wall_s, peak_gb = launch(cmd, exp_dir, timeout_s, f"the actor job did not finish {steps} steps", "actor job")
    rows = read_metrics(os.path.join(exp_dir, "actor", "metrics.jsonl"))
    bad = [r["step"] for r in rows if r["rollout/response_length_mean"] != w.response_len]
    if bad:
        raise RuntimeError(
            f"steps {bad}: responses shorter than {w.response_len} tokens: EOS was not ignored (sampling.ignore_eos)"
        )
    timings = [{k.removeprefix("timing/"): v for k, v in r.items() if k.startswith("timing/")} for r in rows]
    timings, profiled = split_profiled(timings, exp_dir, steps, profile)
    checks = {
        "kl_step0": rows[0]["ppo/kl"],
        "logprob_mismatch_max": max(r["ppo/logprob_mismatch_max"] for r in rows),
        "logprob_mismatch_mean": max(r["ppo/logprob_mismatch"] for r in rows),
        "ended_fraction_max": max(r["rollout/ended_fraction"] for r in rows),
        "response_length_mean": rows[-1]["rollout/response_length_mean"],
        "samples_per_step": rows[-1]["rollout/samples"],
        "kl_loss_last": rows[-1].get("ppo/kl_loss"),
        "update_logprobs_reused": min(r.get("ppo/update_logprobs_reused", 0.0) for r in rows),  # issue 17
    }
    return result(
        "grpo",
        w,
        timings,
        warmup,
        gpus=gpus_used(_visible_gpus(), actor_gpus),
        wall_s=wall_s,
        memory={"gpu_mem_peak_gb": peak_gb},
        device=_device_name(),
        checks=checks,
        exp_dir=exp_dir,
        versions={k: _version(k) for k in ("torch", "megatron-core")},
        settings={
            "actor_config": actor_config,
            "actor_overrides": list(actor_overrides),
            "actor_gpus": actor_gpus,
            "hf_config": hf_config,
        },
        **profiled,
    )
