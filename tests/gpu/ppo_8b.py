"""GPU check (by hand on a two-GPU machine; not collected by pytest): issue 12's 8B-class PPO step.

    python tests/gpu/ppo_8b.py OUT_DIR [--micro 16] [--forward-micro 16] [--recompute full] [--steps 3]
        [--reference swap|resident] [--critic-dp 1|2] [--profile] [--set generation.release_kv_cache=true ...]
    python tests/gpu/ppo_8b.py OUT_DIR --tiny     # CPU smoke of the same plumbing (tiny model, 2 gloo ranks)

The actor job at TP=2 (or DP=2 with --tp 1) on GPUs 0,1 (32 layers, hidden 4096, 32 heads, 8 KV groups, FFN
14336, vocabulary 32000, random weights, bf16; the reference swapped to the host unless --reference resident), the
~1B critic and reward model of conf/bench/ppo_step_critic.yaml on GPU 1; 256 rollouts of 128 prompt + 256 generated
tokens (EOS ignored), one PPO epoch of one mini-batch. Prints the mean phase times of the steps after the first,
the training phases' model TFLOP/s (6·N·tokens for the update, 2·N·tokens per forward pass: policy and reference
log-probs), KL at step 0, the log-prob mismatch and each GPU's peak memory (nvidia-smi), and writes
OUT_DIR/ppo_8b.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.ppo_step.aligner_jobs import read_metrics, write_prompts, write_tokenizer  # noqa: E402
from benchmarks.ppo_step.workload import DeviceMemoryPoller  # noqa: E402

SHAPE_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336)
SHAPE_TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
PEAK_TFLOPS = 790.0  # bf16 matmul peak measured on the H200 (docs/PERF.md)


def non_embedding_params(shape: dict, vocab: int) -> int:
    h, f, layers = shape["hidden_size"], shape["ffn_hidden_size"], shape["num_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_query_groups"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h
    return layers * per_layer + h + h * vocab  # + final norm + output layer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--micro", type=int, default=16, help="ppo.micro_batch_size")
    p.add_argument("--forward-micro", type=int, default=16, help="ppo.forward_micro_batch_size")
    p.add_argument("--recompute", default="full", help="model.recompute of the actor")
    p.add_argument("--reference", default="swap", choices=["swap", "resident"], help="reference.mode")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="another actor override")
    p.add_argument("--tp", type=int, default=2, choices=[1, 2], help="2: TP=2; 1: DP=2 (two full replicas)")
    p.add_argument("--layers", type=int, default=None, help="another depth of the 8B shape (the largest policy)")
    p.add_argument(
        "--critic-dp", type=int, default=1, choices=[1, 2], help="2: the critic job at DP=2 on both GPUs (not on GPU 1)"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--profile", action="store_true", help="one more step under torch.profiler on both ranks, not in the means"
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--timeout", type=float, default=560.0)
    a = p.parse_args()
    shape = dict(SHAPE_TINY if a.tiny else SHAPE_8B)
    if a.layers:
        shape["num_layers"] = a.layers
    vocab, rollouts, prompt_len, response_len = (256, 8, 8, 8) if a.tiny else (32000, 256, 128, 256)
    exp = os.path.abspath(a.out_dir)
    os.makedirs(exp, exist_ok=False)
    tokenizer, prompts = os.path.join(exp, "tokenizer.json"), os.path.join(exp, "prompts.jsonl")
    write_tokenizer(tokenizer, vocab)
    write_prompts(prompts, rollouts, prompt_len - 1, vocab)
    suffix = "_tiny" if a.tiny else ""
    actor = [
        *(f"model.{k}={v}" for k, v in shape.items()),
        f"model.vocab_size={vocab}",
        f"model.recompute={a.recompute}",
        f"parallel.tensor_model_parallel_size={a.tp}",
        f"reference.mode={a.reference}",
        f"ppo.rollout_batch_size={rollouts}",
        # at most the rollouts of a data-parallel rank (the --tiny smoke has 8 rollouts)
        f"ppo.micro_batch_size={min(a.micro, rollouts * a.tp // 2)}",
        f"ppo.forward_micro_batch_size={min(a.forward_micro, rollouts * a.tp // 2)}",
        f"generation.max_batch_size={rollouts * a.tp // 2}",  # this rank's rows: the DP size is 2 / TP
        f"ppo.num_steps={a.steps + a.profile}",
        *([f"logging.profile_step={a.steps}", "logging.profile_ranks=[0,1]"] if a.profile else []),
        f"data.train_file={prompts}",
        f"model.tokenizer={tokenizer}",
        *a.set,
    ]
    critic = [
        "checkpoint.resume=false",
        f"train.global_batch_size={rollouts}",
        f"train.micro_batch_size={min(a.micro, rollouts)}",
        f"server.max_batch_size={rollouts}",
    ]
    cmd = [
        sys.executable, os.path.join(ROOT, "launchers", "local", "ppo.py"),
        "--actor-config", f"bench/ppo_step_actor{suffix}", "--critic-config", f"bench/ppo_step_critic{suffix}",
        "--exp-dir", exp, "--actor-procs", "2", "--critic-procs", str(a.critic_dp),
        *([] if a.tiny else ["--actor-gpus", "0,1", "--critic-gpus", "1" if a.critic_dp == 1 else "0,1"]),
        "--actor", *actor, "--critic", *critic,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    pollers = {gpu: DeviceMemoryPoller(gpu=gpu).start() for gpu in ("0", "1")}  # None where there is no GPU
    start = time.monotonic()
    with open(os.path.join(exp, "launcher.log"), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:  # report the steps done; the launcher stops both jobs on SIGTERM
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.monotonic() - start
    for poller in pollers.values():
        poller.stop()
    metrics = os.path.join(exp, "actor", "metrics.jsonl")
    rows = read_metrics(metrics) if os.path.exists(metrics) else []
    result = {"rc": proc.returncode, "wall_s": round(wall, 1), "steps": len(rows), "settings": vars(a)}
    # the rise of each GPU's used memory over its level at start (nvidia-smi: every process, caches included)
    result["gpu_mem_peak_gb"] = {gpu: poller.peak_gb() for gpu, poller in pollers.items()}
    if a.profile and len(rows) > a.steps:  # the profiled step: its phases and where its summaries are
        result["profiled_step_s"] = {k.removeprefix("timing/"): v for k, v in rows[a.steps].items() if "timing/" in k}
        result["profile_dir"] = os.path.join(exp, "actor", "profile")
        rows = rows[: a.steps]
    timed = rows[1:] or rows
    if timed:
        phases = sorted({k for r in timed for k in r if k.startswith("timing/")})
        mean = {k.removeprefix("timing/"): sum(r.get(k, 0.0) for r in timed) / len(timed) for k in phases}
        tokens = rollouts * (prompt_len + response_len)
        n = non_embedding_params(shape, vocab)
        result.update(
            phases_s={k: round(v, 3) for k, v in mean.items()},
            kl_step0=rows[0].get("ppo/kl"),
            logprob_mismatch=max(r.get("ppo/logprob_mismatch", float("nan")) for r in rows),
            # per GPU: the actor's two ranks (TP=2, or DP=2 at --tp 1) share the work
            train_tflops_per_gpu=6 * n * tokens / mean["train"] / 1e12 / 2 if mean.get("train") else None,
            logprobs_tflops_per_gpu=2 * 2 * n * tokens / mean["logprobs"] / 1e12 / 2 if mean.get("logprobs") else None,
        )
        for key in ("train", "logprobs"):
            if result.get(f"{key}_tflops_per_gpu"):
                result[f"{key}_mfu"] = round(result[f"{key}_tflops_per_gpu"] / PEAK_TFLOPS, 3)
    if proc.returncode != 0:
        with open(os.path.join(exp, "launcher.log"), errors="replace") as f:
            result["tail"] = f.read()[-3000:]
    with open(os.path.join(exp, "ppo_8b.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
