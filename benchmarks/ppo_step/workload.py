"""What one benchmarked PPO (or GRPO) step does, and the result record every mode writes.

A step: `rollouts` prompts of exactly `prompt_len` tokens (BOS included), one sampled response each of exactly
`response_len` tokens (EOS ignored), log-probs under policy and reference, values and reward-model scores, GAE, then
`epochs` passes of `num_mini_batches` optimizer steps for the policy and for the critic, every forward in
micro-batches of `micro_batch` rows. `gen_batch` is how many prompts one generate call takes. Policy, reference,
critic and reward model share one Llama-style shape. Tokens per second = rollouts x (prompt_len + response_len) /
mean step seconds. A GRPO step (`GRPO_FULL`, `GRPO_TINY`) draws `rollouts / samples_per_prompt` prompts and
`samples_per_prompt` responses to each, scores them with a reward function and has no critic. Pure Python:
importable without torch's extras, megatron or omegaconf.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import threading
from dataclasses import asdict, dataclass, replace

from benchmarks.shapes import PRESETS

MODEL_KEYS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "dtype",
)


@dataclass(frozen=True)
class Workload:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    dtype: str  # bfloat16 | float32
    rollouts: int
    prompt_len: int
    response_len: int
    micro_batch: int
    gen_batch: int
    num_mini_batches: int = 1
    epochs: int = 1
    samples_per_prompt: int = 1  # rollouts = prompts x samples_per_prompt (GRPO's groups)

    @property
    def prompts(self) -> int:
        return self.rollouts // self.samples_per_prompt

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @property
    def step_tokens(self) -> int:
        """Rollout tokens per step (prompt + response), the numerator of tokens/s."""
        return self.rollouts * self.seq_len

    def validate(self) -> None:
        if self.prompt_len < 2:
            raise ValueError(f"prompt_len={self.prompt_len}: needs BOS plus at least one word")
        mini = self.rollouts // self.num_mini_batches
        if self.rollouts % self.num_mini_batches or mini % self.micro_batch:
            raise ValueError(
                f"rollouts={self.rollouts} must split into num_mini_batches={self.num_mini_batches} "
                f"mini-batches of whole micro-batches of {self.micro_batch}"
            )
        if self.rollouts % self.samples_per_prompt:
            raise ValueError(
                f"rollouts={self.rollouts} is not a multiple of samples_per_prompt={self.samples_per_prompt}"
            )
        if self.rollouts % self.gen_batch:
            raise ValueError(f"rollouts={self.rollouts} is not a multiple of gen_batch={self.gen_batch}")

    def as_dict(self) -> dict:
        return asdict(self)

    def with_(self, **changes) -> "Workload":
        return replace(self, **changes)

    def shaped_as(self, model) -> "Workload":
        """This workload on the shape of ModelConfig `model` (bench_ppo_step's --hf-config), its dtype kept."""
        shape = model_shape(model)
        del shape["dtype"]
        return replace(self, **shape)


def model_shape(model) -> dict:
    """The MODEL_KEYS of ModelConfig `model` as a Workload holds them (KV groups counted, its params_dtype)."""
    shape = {k: getattr(model, k) for k in MODEL_KEYS if k != "dtype"}
    shape["num_query_groups"] = model.num_query_groups or model.num_attention_heads
    shape["dtype"] = model.params_dtype
    return shape


# The issue's setting: ~1.1B Llama-style (DESIGN.md; the benchmarks' 1B shape), 512 rollouts of 128 + 256 tokens,
# micro-batches of 16.
FULL = Workload(
    **{k: v for k, v in PRESETS["1b"].items() if k in MODEL_KEYS},
    dtype="bfloat16",
    rollouts=512,
    prompt_len=128,
    response_len=256,
    micro_batch=16,
    gen_batch=512,
)
# CPU smoke size: same code paths, two micro-batches per pass so accumulation is exercised.
TINY = Workload(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    dtype="float32",
    rollouts=8,
    prompt_len=8,
    response_len=8,
    micro_batch=4,
    gen_batch=8,
)

# The GRPO step of issue 16: the ~1B policy, 64 prompts x 8 samples of 128 + 256 tokens (EOS ignored), a reward
# function, KL 0.04 as a loss term against a resident reference, one optimizer step per rollout batch.
GRPO_FULL = FULL.with_(samples_per_prompt=8)
# CPU smoke size: 4 prompts x 2 samples of 8 + 8 tokens.
GRPO_TINY = TINY.with_(samples_per_prompt=2)

# Phases in table order; each mode reports the subset it has (aligner's critic work runs in the critic job, where
# the actor sees only the time it waits for it; with a critic, the reward wait is part of critic_wait).
PHASES = (
    "generate",
    "logprobs",
    "values_rewards",
    "critic_wait",
    "reward_wait",
    "advantages",
    "train",
    "refit",
    "critic_train",
)


def summarize(step_timings: list[dict], warmup: int) -> tuple[dict, list[dict]]:
    """Mean seconds per phase over the steps after `warmup`; `step` is the whole step and `other` the part of it
    no phase covers. Returns (means, timed steps)."""
    timed = step_timings[warmup:]
    if not timed:
        raise ValueError(f"{len(step_timings)} steps recorded, none left after {warmup} warm-up steps")
    keys = sorted({k for row in timed for k in row})
    means = {k: statistics.fmean(row.get(k, 0.0) for row in timed) for k in keys}
    means["other"] = max(0.0, means["step"] - sum(v for k, v in means.items() if k in PHASES))
    return means, timed


def gpus_used(visible: int, *device_lists: str | None) -> int:
    """GPUs a run occupies: the union of its jobs' device lists ("0,1", "1"); without lists every process takes the
    first visible device (one GPU, none on the CPU)."""
    given = [d for d in device_lists if d is not None]
    if not given:
        return min(visible, 1)
    return len({g.strip() for d in given for g in d.split(",") if g.strip()})


def result(mode: str, workload: Workload, step_timings: list[dict], warmup: int, gpus: int = 0, **extra) -> dict:
    """The JSON record of one mode (see the package docstring); `gpus`: how many the run occupied (0 on the CPU),
    for the per-GPU throughput."""
    means, timed = summarize(step_timings, warmup)
    return {
        "mode": mode,
        "workload": workload.as_dict(),
        "warmup_steps": warmup,
        "timed_steps": len(timed),
        "phases_s": {k: v for k, v in means.items() if k != "step"},
        "step_s": means["step"],
        "tokens_per_s": workload.step_tokens / means["step"],
        "gpus": gpus,
        "tokens_per_s_per_gpu": workload.step_tokens / means["step"] / gpus if gpus else None,
        "generated_tokens_per_s": workload.rollouts * workload.response_len / means["generate"],
        "per_step_s": step_timings,
        **extra,
    }


def write_json(path: str, obj: dict) -> None:
    """Write to a temporary file, then rename (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


class DeviceMemoryPoller:
    """Peak memory used on the GPU as the driver reports it (every process on the device, CUDA contexts and
    allocator caches included), sampled with nvidia-smi in a thread. `peak_gb()` is the rise over the level
    before `start()`; None where nvidia-smi is absent (CPU runs). `gpu`: nvidia-smi's index of the GPU to watch
    (default: the first one CUDA_VISIBLE_DEVICES names, else 0)."""

    def __init__(self, interval_s: float = 0.5, gpu: str | None = None):
        self.interval_s = interval_s
        self.smi = shutil.which("nvidia-smi")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
        self.gpu = gpu or visible or "0"
        self.baseline_mib = self.max_mib = None
        self._stop = threading.Event()
        self._thread = None

    def _read_mib(self) -> float | None:
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", self.gpu],
                capture_output=True,
                text=True,
                timeout=10,
            )
            return float(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def start(self) -> "DeviceMemoryPoller":
        if self.smi is None or not os.environ.get("CUDA_VISIBLE_DEVICES", "x"):
            return self
        self.baseline_mib = self._read_mib()
        if self.baseline_mib is None:
            return self
        self.max_mib = self.baseline_mib

        def loop():
            while not self._stop.wait(self.interval_s):
                used = self._read_mib()
                if used is not None:
                    self.max_mib = max(self.max_mib, used)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def peak_gb(self) -> float | None:
        if self.max_mib is None:
            return None
        return (self.max_mib - self.baseline_mib) * 2**20 / 1e9
