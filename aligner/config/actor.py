"""The actor job's config schema (`conf/ppo_actor.yaml`): policy model, generation engine, the RL loop (`ppo`),
the reward source (`reward`), data, critic client.

Batch vocabulary (NeMo-Aligner's, with groups): each step samples `ppo.rollout_batch_size` prompts across the whole
job and `ppo.n_samples_per_prompt` responses to each (a group), split evenly over data-parallel ranks in whole
groups; the policy then trains `ppo.epochs` passes over those rollouts in `ppo.num_mini_batches` optimizer steps per
pass, each mini-batch run as micro-batches of `ppo.micro_batch_size` responses.
`ppo.advantage_estimator` picks the algorithm: `gae` (PPO with the critic job's value model), `grpo`, `rloo` or
`reinforce_pp` (no value model; scores from `reward.source`: the critic job's reward, or a reward function run by
the actor job itself).
`validate()` runs at load; `validate_world(world_size)` once the number of ranks is known (before any communicator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Sequence

from aligner.config.critic import CriticClientConfig
from aligner.config.errors import ConfigError
from aligner.config.generation import GenerationConfig, validate_generation
from aligner.config.loader import REPO_CONF_DIR, load_config, parse_cli
from aligner.config.paths import JobPaths, resolve_function
from aligner.config.rules import check, check_choices
from aligner.config.schema import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfiledLoggingConfig,
    validate_checkpoint,
    validate_layout,
    validate_model,
    validate_optim,
    validate_profiling,
)


@dataclass
class DataConfig:
    """Prompt files (formats and examples: docs/DATA.md): JSONL, Parquet or a saved HF dataset directory; each row a
    plain prompt or a chat (rendered with the tokenizer's chat template), and an optional label."""

    train_file: str = "conf/demo/prompts_train.jsonl"  # prompts: a .jsonl or .parquet file, or a saved HF dataset dir
    val_file: Optional[str] = None  # held-out prompts for validation (same format); None = no validation set
    prompt_key: str = "prompt"  # the row field holding a plain prompt (tokenised as the HF tokenizer does)
    messages_key: str = "messages"  # the row field holding a chat: [{"role", "content"}, ...] for the chat template
    label_key: str = "label"  # the row field passed to the reward function as its label (optional in each row)
    long_prompts: Literal["skip", "truncate_left", "error"] = "skip"  # prompts over generation.max_prompt_length
    tokenizer: Optional[str] = None  # None = model.tokenizer; tokenizer.json or an HF tokenizer directory
    shuffle: bool = True  # a new seeded permutation of the prompts every epoch
    seed: int = 1234  # seed of the prompt order


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # divides the logits before sampling (and training's log-probs)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    greedy: bool = False  # argmax instead of sampling
    min_new_tokens: int = 0  # EOS and stop tokens cannot end a response shorter than this
    max_new_tokens: Optional[int] = None  # None = generation.max_response_length
    ignore_eos: bool = False  # EOS and stop tokens end nothing: every response has max_new_tokens (benchmarks)

    @property
    def logprob_temperature(self) -> float:
        """The temperature the engine's sampling distribution used, which training's log-probs must use too."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class KLConfig:
    coef: float = 0.02  # beta: of the per-token -beta * KL reward, or of the KL loss term (placement: loss)
    placement: Literal["reward", "loss"] = "reward"  # reward: PPO's penalty in the rewards | loss: GRPO's loss term
    estimator: Literal["k1", "k2", "k3"] = "k1"  # per-token KL estimator (Schulman's k1, k2, k3); GRPO's loss: k3
    use_absolute_kl: bool = False  # use |k1| (NeMo-Aligner's option)
    adaptive: bool = False  # adapt coef towards the target KL (Ziegler et al.'s controller)
    target: float = 6.0  # the KL the adaptive controller aims for, in `target_units`
    target_units: Literal["sample", "token"] = "sample"  # sample: summed over a response (Ziegler's) | token: mean
    horizon: int = 10000  # horizon (in samples) of the adaptive controller


@dataclass
class DynamicSamplingConfig:
    """DAPO's dynamic sampling: groups whose rewards are all equal (zero advantage under a group baseline) are
    dropped and more prompts drawn until the step has `ppo.rollout_batch_size` groups, at most `max_draws` draws
    of `ppo.rollout_batch_size` prompts each; if the cap is reached, dropped groups fill the rest (in draw order)."""

    enabled: bool = False  # drop groups whose rewards are all equal and draw again (grpo, rloo)
    max_draws: int = 4  # at most this many draws of ppo.rollout_batch_size prompts per step


@dataclass
class OverlongConfig:
    """DAPO's soft overlong punishment: responses longer than max_new_tokens - buffer lose up to `penalty` from
    their score, linearly, reaching -penalty at max_new_tokens. buffer 0 = off. (DAPO's overlong filtering is
    `ppo.zero_unended`.)"""

    buffer: int = 0  # tokens before max_new_tokens where the penalty starts (0 = off)
    penalty: float = 1.0  # the penalty at max_new_tokens (it grows linearly over the buffer)


@dataclass
class PPOConfig:
    num_steps: int = 100  # RL steps (rollout + update) to run
    advantage_estimator: Literal["gae", "grpo", "rloo", "reinforce_pp"] = "gae"  # aligner.rl.estimators
    rollout_batch_size: int = 64  # prompts per step, whole job
    n_samples_per_prompt: int = 1  # responses per prompt, generated together and kept together (grpo/rloo: >= 2)
    normalize_group_std: bool = True  # grpo: divide by the group's std (false: Dr. GRPO's mean-only baseline)
    num_mini_batches: int = 1  # optimizer steps per epoch over the rollouts
    micro_batch_size: int = 4  # rows per forward/backward pass of the policy update
    forward_micro_batch_size: Optional[int] = None  # rows per forward-only pass (log-probs); None = micro_batch_size
    # Rows go into micro-batches longest first, each run at its own longest row's width instead of the step's: right
    # padding changes no causal output, so the losses are the same with less padding computed; off under PP.
    trim_padding: int = 64  # micro-batches cut to their longest row, rounded up to this many tokens (0 = off)
    # Micro-batches by tokens instead of rows (every pass): short rows go many to a micro-batch, long rows few.
    micro_batch_tokens: Optional[int] = None  # rows x width a micro-batch holds at most (>= 1 row); null = by rows
    epochs: int = 1  # passes over each step's rollouts
    # One epoch of one mini-batch, KL in the loss (or none): the update's own forward gives the "old" log-probs
    # (ratio 1 exactly), so the separate policy log-prob pass is skipped; the KL/mismatch metrics come from the update.
    reuse_update_logprobs: bool = True  # skip the policy log-prob pass when the update's forward gives the same
    clip_eps: float = 0.2  # PPO ratio clip: 1 - clip_eps .. 1 + clip_eps
    clip_eps_high: Optional[float] = None  # asymmetric upper clip (None = clip_eps)
    dual_clip: Optional[float] = None  # c > 1 enables dual-clip PPO
    # Rollouts drawn off the trained policy (generation.decode_weights=fp8): truncated importance sampling
    rollout_correction_cap: Optional[float] = None  # PG term per token x min(p_old / p_engine, cap); None = off
    entropy_coef: float = 0.0  # weight of the entropy bonus in the policy loss
    gamma: float = 1.0  # discount of the returns
    lam: float = 0.95  # lambda of GAE (gae only)
    whiten_advantages: bool = True  # gae: advantages to mean 0, std 1 over the step's tokens (reinforce_pp always)
    zero_unended: bool = False  # samples cut at the length limit get no policy gradient (DAPO's overlong filter)
    score_clip: Optional[float] = None  # clip the reward score to +-score_clip
    critic_warmup_steps: int = 0  # steps that train only the critic (gae)
    kl: KLConfig = field(default_factory=KLConfig)  # the KL to the reference policy: in the reward or in the loss
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)  # DAPO: drop constant groups
    overlong: OverlongConfig = field(default_factory=OverlongConfig)  # DAPO's soft overlong punishment


@dataclass
class RewardConfig:
    """Where the scores come from. critic: the critic job's critic_infer (its reward model or reward function;
    with gae also its values). function: `fn` run by the actor job itself, in `num_workers` processes on the first
    tensor/pipeline-parallel rank of each data-parallel slice (aligner.rewards; critic-free estimators only)."""

    source: Literal["critic", "function"] = "critic"  # critic: the critic job's critic_infer | function: reward.fn
    fn: Optional[str] = None  # path.py or path.py:name (default name reward_fn); docs/REWARDS.md
    num_workers: int = 2  # worker processes per data-parallel slice
    timeout: float = 60.0  # seconds one call may take before its worker is killed and the run stops
    samples_per_call: int = 1  # samples per call of fn (a failure names the call's samples)


@dataclass
class ReferenceConfig:
    mode: Literal["resident", "swap"] = "resident"  # resident: a frozen copy on the device | swap: kept on the host


@dataclass
class LoggingConfig(ProfiledLoggingConfig):
    tensorboard: bool = True  # also write metrics to <exp_dir>/tensorboard
    samples_every: int = 5  # write decoded samples every N steps (0 = never)
    num_samples: int = 4  # samples written each time
    progress_bar: bool = True  # a progress bar on the logging rank


@dataclass
class ActorCheckpointConfig(CheckpointConfig):
    save_every: int = 0  # steps between checkpoints (0 = only at the end / on SIGTERM / max_time)
    save_critic: bool = True  # gae: the critic job checkpoints the same step (critic_save); critic-free: unused
    save_at_end: bool = True  # checkpoint after the last step


@dataclass
class ValidationConfig:
    every: int = 0  # steps between validations (0 = never)
    greedy: bool = True  # greedy responses for validation (else sampled as in training)
    max_prompts: int = 64  # validate on the first N prompts of data.val_file


@dataclass
class ActorJobConfig(JobPaths):
    MODEL_SECTIONS: ClassVar[tuple[str, ...]] = ("model",)  # filled from their checkpoint's model.yaml at load
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy (and the reference: its initial weights)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how the policy is split over the ranks
    optim: OptimConfig = field(default_factory=OptimConfig)  # the policy's optimizer
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # the engine that samples responses
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how response tokens are drawn
    ppo: PPOConfig = field(default_factory=PPOConfig)  # batch sizes, groups, the advantage estimator and the loss
    reward: RewardConfig = field(default_factory=RewardConfig)  # where the scores come from (docs/REWARDS.md)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)  # where the frozen reference policy lives
    data: DataConfig = field(default_factory=DataConfig)  # prompt files (docs/DATA.md) and the tokenizer
    critic: CriticClientConfig = field(default_factory=CriticClientConfig)  # where the critic job listens
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # metrics, samples, progress
    checkpoint: ActorCheckpointConfig = field(default_factory=ActorCheckpointConfig)  # saving and resuming
    validation: ValidationConfig = field(default_factory=ValidationConfig)  # scores on held-out prompts
    exp_dir: str = "results/ppo_actor"  # metrics.jsonl, samples, TensorBoard, checkpoints
    seed: int = 1234  # seed of initialisation, sampling and mini-batch order
    max_time: Optional[float] = None  # seconds; checkpoint and stop cleanly once exceeded

    def validate(self) -> None:
        check_choices(self)
        validate_model(self.model)
        validate_optim(self.optim)
        validate_generation(self.generation, self.model)
        validate_checkpoint(self.checkpoint)
        validate_profiling(self.logging)
        p, s, k = self.ppo, self.sampling, self.ppo.kl
        for key in (
            "num_steps",
            "rollout_batch_size",
            "n_samples_per_prompt",
            "num_mini_batches",
            "micro_batch_size",
            "epochs",
        ):
            check(getattr(p, key) >= 1, f"ppo.{key}", f"must be >= 1, got {getattr(p, key)}")
        check(
            p.forward_micro_batch_size is None or p.forward_micro_batch_size >= 1,
            "ppo.forward_micro_batch_size",
            f"must be >= 1 (or null), got {p.forward_micro_batch_size}",
        )
        check(p.trim_padding >= 0, "ppo.trim_padding", f"must be >= 0 (0: off), got {p.trim_padding}")
        check(
            p.micro_batch_tokens is None or p.micro_batch_tokens >= 1,
            "ppo.micro_batch_tokens",
            f"must be >= 1 (or null: micro-batches by rows), got {p.micro_batch_tokens}",
        )
        check(
            p.micro_batch_tokens is None or self.parallel.pipeline_model_parallel_size == 1,
            "ppo.micro_batch_tokens",
            "needs pipeline_model_parallel_size=1 (under PP every micro-batch has one shape); set it to null",
        )
        check(0 < p.clip_eps < 1, "ppo.clip_eps", f"must be in (0, 1), got {p.clip_eps}")
        check(
            p.clip_eps_high is None or 0 < p.clip_eps_high < 10,
            "ppo.clip_eps_high",
            f"must be in (0, 10) (or null), got {p.clip_eps_high}",
        )
        check(p.dual_clip is None or p.dual_clip > 1, "ppo.dual_clip", f"must be > 1 (or null), got {p.dual_clip}")
        check(
            p.rollout_correction_cap is None or p.rollout_correction_cap >= 1,
            "ppo.rollout_correction_cap",
            f"must be >= 1 (or null: off), got {p.rollout_correction_cap}; 2 is a common choice",
        )
        check(0 <= p.gamma <= 1, "ppo.gamma", f"must lie in [0, 1], got {p.gamma}")
        check(0 <= p.lam <= 1, "ppo.lam", f"must lie in [0, 1], got {p.lam}")
        check(math.isfinite(k.coef) and k.coef >= 0, "ppo.kl.coef", f"must be a finite number >= 0, got {k.coef}")
        check(p.critic_warmup_steps >= 0, "ppo.critic_warmup_steps", "must be >= 0")
        check(k.target > 0 and k.horizon >= 1, "ppo.kl.target", "ppo.kl.target must be > 0 and ppo.kl.horizon >= 1")
        self._validate_algorithm()
        check(
            s.greedy or (math.isfinite(s.temperature) and s.temperature > 0),
            "sampling.temperature",
            f"must be > 0 (or set sampling.greedy=true), got {s.temperature}",
        )
        check(s.top_k >= 0, "sampling.top_k", f"must be >= 0 (0 disables top-k), got {s.top_k}")
        check(0 < s.top_p <= 1, "sampling.top_p", f"must be in (0, 1] (1 disables top-p), got {s.top_p}")
        check(s.min_new_tokens >= 0, "sampling.min_new_tokens", f"must be >= 0, got {s.min_new_tokens}")
        check(
            s.max_new_tokens is None or 1 <= s.max_new_tokens <= self.generation.max_response_length,
            "sampling.max_new_tokens",
            f"must be in 1..generation.max_response_length={self.generation.max_response_length}",
        )
        check(self.max_time is None or self.max_time > 0, "max_time", "must be > 0 seconds (or null)")
        check(self.logging.samples_every >= 0, "logging.samples_every", "must be >= 0")
        check(self.validation.every >= 0, "validation.every", "must be >= 0")
        check(self.checkpoint.save_every >= 0, "checkpoint.save_every", "must be >= 0")
        check(
            self.data.prompt_key != self.data.messages_key,
            "data.messages_key",
            f"must differ from data.prompt_key (both are {self.data.prompt_key!r}): a row holds a prompt or a chat",
        )

    def _validate_algorithm(self) -> None:
        """The estimator, groups, reward source and DAPO options fit together."""
        p, r = self.ppo, self.reward
        est, n = p.advantage_estimator, p.n_samples_per_prompt
        if est == "gae":
            check(
                r.source == "critic",
                "reward.source",
                "ppo.advantage_estimator=gae trains the critic job's value model: set reward.source=critic, or pick a "
                "critic-free estimator (grpo, rloo, reinforce_pp)",
            )
        else:
            check(
                p.critic_warmup_steps == 0,
                "ppo.critic_warmup_steps",
                f"ppo.advantage_estimator={est} has no critic to warm up: set it to 0",
            )
        if est in ("grpo", "rloo"):
            check(n >= 2, "ppo.n_samples_per_prompt", f"{est} compares the samples of a prompt: needs >= 2, got {n}")
        if r.source == "function":
            check(r.fn is not None, "reward.fn", "reward.source=function needs reward.fn (path.py or path.py:name)")
        check(r.num_workers >= 1, "reward.num_workers", f"must be >= 1, got {r.num_workers}")
        check(r.samples_per_call >= 1, "reward.samples_per_call", f"must be >= 1, got {r.samples_per_call}")
        check(math.isfinite(r.timeout) and r.timeout > 0, "reward.timeout", f"must be > 0 seconds, got {r.timeout}")
        d = p.dynamic_sampling
        if d.enabled:
            check(
                est in ("grpo", "rloo") and n >= 2,
                "ppo.dynamic_sampling.enabled",
                "drops groups whose rewards are all equal: needs ppo.advantage_estimator grpo or rloo",
            )
        check(d.max_draws >= 1, "ppo.dynamic_sampling.max_draws", f"must be >= 1, got {d.max_draws}")
        o, max_new = p.overlong, self.max_new_tokens
        check(
            0 <= o.buffer <= max_new,
            "ppo.overlong.buffer",
            f"must be in 0..{max_new} (the response length limit; 0 = off), got {o.buffer}",
        )
        check(math.isfinite(o.penalty) and o.penalty >= 0, "ppo.overlong.penalty", "must be a finite number >= 0")
        check(
            self.generation.max_batch_size >= n,
            "generation.max_batch_size",
            f"{self.generation.max_batch_size} < ppo.n_samples_per_prompt={n}: a prompt's samples go in one call",
        )

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens or self.generation.max_response_length

    @property
    def samples_per_step(self) -> int:
        return self.ppo.rollout_batch_size * self.ppo.n_samples_per_prompt

    def validate_world(self, world_size: int) -> int:
        """Layout and batch divisibility on `world_size` ranks; returns the data-parallel size."""
        dp = validate_layout(self.model, self.parallel, world_size)
        p = self.ppo
        if p.rollout_batch_size % dp:
            raise ConfigError(
                "ppo.rollout_batch_size", f"{p.rollout_batch_size} is not divisible by the data-parallel size {dp}"
            )
        per_rank = p.rollout_batch_size // dp
        if per_rank % p.num_mini_batches:
            raise ConfigError(
                "ppo.num_mini_batches",
                f"{per_rank} rollouts per data-parallel rank are not divisible "
                f"by ppo.num_mini_batches={p.num_mini_batches}",
            )
        if (
            p.micro_batch_tokens is None
            and (per_rank // p.num_mini_batches) * p.n_samples_per_prompt % p.micro_batch_size
        ):
            raise ConfigError(
                "ppo.micro_batch_size",
                f"a mini-batch of {per_rank // p.num_mini_batches * p.n_samples_per_prompt} rollouts per "
                f"data-parallel rank is not divisible by ppo.micro_batch_size={p.micro_batch_size}",
            )
        return dp

    def resolve_paths(self, config_dir: Optional[str] = None) -> None:
        super().resolve_paths(config_dir)
        self.reward.fn = resolve_function(self.reward.fn, "reward.fn", config_dir)


def load_actor_config(argv: Sequence[str], default_name: str = "ppo_actor") -> ActorJobConfig:
    config_dir, name, overrides = parse_cli(argv, default_name)
    cfg = load_config(ActorJobConfig, name, overrides, config_dir)
    cfg.resolve_paths(config_dir or REPO_CONF_DIR)
    return cfg
