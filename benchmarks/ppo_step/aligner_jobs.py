"""aligner's side of the benchmark: the critic job and the actor job on one machine, through launchers/local/ppo.py.

`run(...)` makes a fresh experiment directory with synthetic assets (a WordLevel tokenizer 't0', 't1', ... with
<pad>/<bos>/<eos>, and prompts of exactly prompt_len - 1 words, i.e. prompt_len tokens with BOS), checks with
`check_configs` that conf/bench/ describes the workload the HF loop runs (a difference raises `WorkloadMismatch`
naming the key), runs the launcher for `steps` PPO steps, and reads `timing/*` from the actor's metrics.jsonl.
The actor times: generate, logprobs (policy + reference), critic_wait (waiting for the critic's values/rewards and,
later, for its training: the critic job computes while the actor does), advantages, train, refit, step.
This process only writes files, starts processes and polls GPU memory: it never initialises CUDA itself.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata

from benchmarks.ppo_step.workload import MODEL_KEYS, DeviceMemoryPoller, Workload, gpus_used, model_shape, result

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
LAUNCHER = os.path.join(ROOT, "launchers", "local", "ppo.py")
SPECIALS = ("<pad>", "<bos>", "<eos>")
CRITIC_WAIT_PARTS = ("timing/critic_wait_infer", "timing/critic_wait_train")


class WorkloadMismatch(ValueError):
    """A conf/bench/ setting (after overrides) differs from the workload the HF loop runs."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


# -- assets -------------------------------------------------------------------------------------------------
def write_tokenizer(path: str, vocab_size: int) -> None:
    """A whitespace WordLevel tokenizer of exactly `vocab_size` ids: the specials, then 't0', 't1', ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = [f"t{i}" for i in range(vocab_size - len(SPECIALS))]
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))  # already in the vocabulary: marks them special
    # The tokenizer adds <bos> to each prompt itself (the jobs add no special tokens), as Llama's does.
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    tok.save(path)


def write_prompts(path: str, n: int, words_per_prompt: int, vocab_size: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = " ".join(f"t{rng.randrange(vocab_size - len(SPECIALS))}" for _ in range(words_per_prompt))
            f.write(json.dumps({"prompt": words}) + "\n")


# -- configs ------------------------------------------------------------------------------------------------
def _model_shape(model, prefix: str) -> dict:
    return {f"{prefix}.{k if k != 'dtype' else 'params_dtype'}": v for k, v in model_shape(model).items()}


def check_configs(w: Workload, actor_argv: list[str], critic_argv: list[str]) -> Workload:
    """Load both configs as the jobs will and compare them with `w`; returns `w` with the actor's gen_batch."""
    from aligner.config.actor import load_actor_config
    from aligner.config.critic import load_critic_config

    actor, critic = load_actor_config(actor_argv), load_critic_config(critic_argv)
    want = {f"model.{k if k != 'dtype' else 'params_dtype'}": getattr(w, k) for k in MODEL_KEYS}
    got = dict(_model_shape(actor.model, "model"))
    got.update(
        {
            "ppo.rollout_batch_size": actor.ppo.rollout_batch_size,
            "generation.max_prompt_length": actor.generation.max_prompt_length,
            "generation.max_response_length": actor.generation.max_response_length,
            "ppo.num_mini_batches": actor.ppo.num_mini_batches,
            "ppo.epochs": actor.ppo.epochs,
            "sampling.ignore_eos": actor.sampling.ignore_eos,
            "sampling.max_new_tokens": actor.sampling.max_new_tokens or actor.generation.max_response_length,
            "reference.mode": actor.reference.mode,
        }
    )
    want.update(
        {
            "ppo.rollout_batch_size": w.rollouts,
            "generation.max_prompt_length": w.prompt_len,
            "generation.max_response_length": w.response_len,
            "ppo.num_mini_batches": w.num_mini_batches,
            "ppo.epochs": w.epochs,
            "sampling.ignore_eos": True,
            "sampling.max_new_tokens": w.response_len,
            "reference.mode": "resident",
        }
    )
    if critic.reward_model is None:
        raise WorkloadMismatch(
            "critic: reward_model",
            "the benchmark needs a reward model (reward_model section), as the HF loop runs one; unset reward_fn",
        )
    for section in ("model", "reward_model"):
        got.update(_model_shape(getattr(critic, section), f"critic: {section}"))
        want.update({f"critic: {section}.{k if k != 'dtype' else 'params_dtype'}": getattr(w, k) for k in MODEL_KEYS})
    got.update(
        {
            "critic: train.global_batch_size": critic.train.global_batch_size,
            "critic: train.epochs": critic.train.epochs,
        }
    )
    # Micro-batch sizes (actor ppo.micro_batch_size and forward_micro_batch_size, critic train.micro_batch_size and
    # infer.micro_batch_size) change how the same work is cut, not the work: each optimizer step still averages the
    # loss over the same mini-batch of rollouts (gradients accumulate over its micro-batches). They may differ from
    # the HF loop's; the result records the overrides.
    want.update(
        {
            "critic: train.global_batch_size": w.rollouts // w.num_mini_batches,
            "critic: train.epochs": w.epochs,
        }
    )
    for key, value in want.items():
        if got[key] != value:
            raise WorkloadMismatch(key, f"is {got[key]!r} but the benchmark workload (and the HF loop) uses {value!r}")
    if critic.server.max_batch_size < w.rollouts:
        raise WorkloadMismatch(
            "critic: server.max_batch_size",
            f"{critic.server.max_batch_size} < {w.rollouts}: the actor sends all rollouts in one request",
        )
    return w.with_(gen_batch=min(actor.generation.max_batch_size, w.rollouts))


# -- running ------------------------------------------------------------------------------------------------
def _tail(path: str, lines: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _device_name() -> str:
    smi = shutil.which("nvidia-smi")
    if smi and os.environ.get("CUDA_VISIBLE_DEVICES", "x"):
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip().splitlines()[0]
    return "cpu"


def _visible_gpus() -> int:
    """GPUs this process (and the jobs it launches) can see: CUDA_VISIBLE_DEVICES, else nvidia-smi's list."""
    if _device_name() == "cpu":
        return 0
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return len([d for d in listed.split(",") if d.strip()])
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return len(out.stdout.strip().splitlines())


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch(cmd: list[str], exp_dir: str, timeout_s: float, late: str, what: str) -> tuple[float, float | None]:
    """Run the launcher command `cmd` (its output in `<exp_dir>/launcher.log`), sampling the GPU's memory; returns
    (wall seconds, peak GB or None). Past `timeout_s` the launcher gets SIGTERM (it stops its jobs) and RuntimeError
    says `late`; a non-zero exit is a RuntimeError naming `what`; both carry the log's tail (and the critic's)."""
    # Single-process jobs: each takes a free rendezvous port of its own unless MASTER_PORT forces one on all.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    log_path = os.path.join(exp_dir, "launcher.log")
    critic_log = os.path.join(exp_dir, "critic.log")
    poller = DeviceMemoryPoller().start()
    t0 = time.perf_counter()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGTERM)  # the launcher stops its jobs
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                raise RuntimeError(
                    f"{late} in {timeout_s:.0f} s (--timeout); launcher log {log_path}:\n{_tail(log_path)}"
                ) from None
    finally:
        poller.stop()
    wall_s = time.perf_counter() - t0
    if rc != 0:
        tails = f"launcher log {log_path}:\n{_tail(log_path)}"
        if os.path.exists(critic_log):
            tails += f"\n--- critic log ---\n{_tail(critic_log)}"
        raise RuntimeError(f"the {what} failed (launcher exit {rc}); {tails}")
    return wall_s, poller.peak_gb()


def profile_overrides(steps: int, profile: bool) -> list[str]:
    """The actor's step count, plus with `profile` one more step under the profiler (logging.profile_step)."""
    return [f"ppo.num_steps={steps + 1}", f"logging.profile_step={steps}"] if profile else [f"ppo.num_steps={steps}"]


def split_profiled(timings: list[dict], exp_dir: str, steps: int, profile: bool) -> tuple[list[dict], dict]:
    """With `profile`: the timed steps without the profiled last one (the profiler slows it), and a record of that
    step (its phase seconds and rank 0's summary, aligner.utils.profiling); else (timings, {})."""
    if not profile:
        return timings, {}
    with open(os.path.join(exp_dir, "actor", "profile", f"step{steps}-rank0.summary.json")) as f:
        summary = json.load(f)
    return timings[:steps], {"profile": {"step_s": timings[steps], "summary": summary}}


def run(
    w: Workload,
    steps: int,
    warmup: int,
    actor_config: str,
    critic_config: str,
    exp_dir: str,
    actor_overrides=(),
    critic_overrides=(),
    timeout_s: float = 480.0,
    actor_gpus: str | None = None,
    critic_gpus: str | None = None,
    actor_procs: int = 1,
    critic_procs: int = 1,
    profile: bool = False,
    model_overrides=(),
    critic_model_overrides=(),
    hf_config: str | None = None,
) -> dict:
    """Run the two jobs for `steps` PPO steps in a fresh `exp_dir`; the result record (see workload.result).
    `actor_gpus` / `critic_gpus`: the launcher's --actor-gpus / --critic-gpus (None: both jobs see every GPU);
    `actor_procs` / `critic_procs`: its --actor-procs / --critic-procs (ranks of each job, e.g. DP=2 over two GPUs).
    `profile`: one more step under the profiler, outside the means (split_profiled).
    `model_overrides` / `critic_model_overrides`: the jobs' model sections in one shape (benchmarks.shapes.
    shape_overrides of the Hugging Face config `hf_config`, which the record names), before the user's overrides;
    `w` must have that shape (Workload.shaped_as)."""
    if os.path.exists(exp_dir) and os.listdir(exp_dir):
        raise FileExistsError(f"{exp_dir} is not empty: give a new --exp-dir (a run never resumes an old one)")
    os.makedirs(exp_dir, exist_ok=True)
    tokenizer, prompts = os.path.join(exp_dir, "tokenizer.json"), os.path.join(exp_dir, "prompts.jsonl")
    write_tokenizer(tokenizer, w.vocab_size)
    write_prompts(prompts, w.rollouts, w.prompt_len - 1, w.vocab_size)
    actor_ovr = [
        *profile_overrides(steps, profile),
        f"data.train_file={prompts}",
        f"model.tokenizer={tokenizer}",
        *model_overrides,
        *actor_overrides,
    ]
    critic_ovr = ["checkpoint.resume=false", *critic_model_overrides, *critic_overrides]
    w = check_configs(w, ["--config-name", actor_config, *actor_ovr], ["--config-name", critic_config, *critic_ovr])

    cmd = [
        sys.executable,
        LAUNCHER,
        "--actor-config",
        actor_config,
        "--critic-config",
        critic_config,
        "--exp-dir",
        exp_dir,
        "--actor-procs",
        str(actor_procs),
        "--critic-procs",
        str(critic_procs),
    ]
    for flag, gpus in (("--actor-gpus", actor_gpus), ("--critic-gpus", critic_gpus)):
        if gpus is not None:
            cmd += [flag, gpus]
    cmd += ["--actor", *actor_ovr, "--critic", *critic_ovr]
    wall_s, peak_gb = launch(cmd, exp_dir, timeout_s, f"the aligner jobs did not finish {steps} steps", "aligner jobs")
    rows = read_metrics(os.path.join(exp_dir, "actor", "metrics.jsonl"))
    bad = [r["step"] for r in rows if r["rollout/response_length_mean"] != w.response_len]
    if bad:
        raise RuntimeError(
            f"steps {bad}: responses shorter than {w.response_len} tokens: EOS was not ignored (sampling.ignore_eos)"
        )
    # critic_wait is the sum of the actor's two waits for the critic job (critic_wait_infer, critic_wait_train): the
    # parts are left out, so that the phases partition the step.
    timings = [
        {k.removeprefix("timing/"): v for k, v in r.items() if k.startswith("timing/") and k not in CRITIC_WAIT_PARTS}
        for r in rows
    ]
    timings, profiled = split_profiled(timings, exp_dir, steps, profile)
    checks = {
        "kl_step0": rows[0]["ppo/kl"],
        "logprob_mismatch_max": max(r["ppo/logprob_mismatch_max"] for r in rows),
        "ended_fraction_max": max(r["rollout/ended_fraction"] for r in rows),
        "response_length_mean": rows[-1]["rollout/response_length_mean"],
    }
    return result(
        "aligner",
        w,
        timings,
        warmup,
        gpus=gpus_used(_visible_gpus(), actor_gpus, critic_gpus),
        wall_s=wall_s,
        memory={"gpu_mem_peak_gb": peak_gb},
        device=_device_name(),
        checks=checks,
        exp_dir=exp_dir,
        versions={k: _version(k) for k in ("torch", "megatron-core", "nvidia-pytriton")},
        settings={
            "actor_config": actor_config,
            "critic_config": critic_config,
            "actor_overrides": list(actor_overrides),
            "critic_overrides": list(critic_overrides),
            "actor_gpus": actor_gpus,
            "critic_gpus": critic_gpus,
            "actor_procs": actor_procs,
            "critic_procs": critic_procs,
            "hf_config": hf_config,
        },
        **profiled,
    )
