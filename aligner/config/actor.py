"""The actor job's config schema (`conf/ppo_actor.yaml`): policy model, generation engine, PPO, data, critic client.

Batch vocabulary (NeMo-Aligner's): each step samples `ppo.rollout_batch_size` prompts (one response each) across the
whole job, split evenly over data-parallel ranks; the policy then trains `ppo.epochs` passes over those rollouts in
`ppo.num_mini_batches` optimizer steps per pass, each mini-batch run as micro-batches of `ppo.micro_batch_size`.
`validate()` runs at load; `validate_world(world_size)` once the number of ranks is known (before any communicator).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal, Optional, Sequence

from aligner.config.critic import CriticClientConfig, resolve_file
from aligner.config.errors import ConfigError
from aligner.config.generation import GenerationConfig, validate_generation
from aligner.config.loader import REPO_CONF_DIR, load_config, parse_cli
from aligner.config.rules import check, check_choices
from aligner.config.schema import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    validate_checkpoint,
    validate_layout,
    validate_model,
    validate_optim,
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
    coef: float = 0.02  # beta of the per-token -beta * KL reward
    estimator: Literal["k1", "k2", "k3"] = "k1"  # per-token KL estimator (Schulman's k1, k2, k3)
    use_absolute_kl: bool = False  # use |k1| (NeMo-Aligner's option)
    adaptive: bool = False  # adapt coef towards the target KL (Ziegler et al.)
    target: float = 6.0  # target KL of the adaptive controller
    horizon: int = 10000  # horizon (in samples) of the adaptive controller


@dataclass
class PPOConfig:
    num_steps: int = 100  # PPO steps (rollout + update) to run
    rollout_batch_size: int = 64  # prompts per step, whole job
    num_mini_batches: int = 1  # optimizer steps per epoch over the rollouts
    micro_batch_size: int = 4  # rows per forward/backward pass of the policy update
    forward_micro_batch_size: Optional[int] = None  # rows per forward-only pass (log-probs); None = micro_batch_size
    epochs: int = 1  # passes over each step's rollouts
    clip_eps: float = 0.2  # PPO ratio clip: 1 - clip_eps .. 1 + clip_eps
    clip_eps_high: Optional[float] = None  # asymmetric upper clip (None = clip_eps)
    dual_clip: Optional[float] = None  # c > 1 enables dual-clip PPO
    entropy_coef: float = 0.0  # weight of the entropy bonus in the policy loss
    gamma: float = 1.0  # discount of GAE
    lam: float = 0.95  # lambda of GAE
    whiten_advantages: bool = True  # normalise advantages to mean 0, std 1 over the step's tokens
    zero_unended: bool = False  # NeMo-Aligner: samples cut at the length limit get no policy gradient
    score_clip: Optional[float] = None  # clip the reward score to +-score_clip
    critic_warmup_steps: int = 0  # steps that train only the critic
    kl: KLConfig = field(default_factory=KLConfig)  # the KL penalty against the reference policy


@dataclass
class ReferenceConfig:
    mode: Literal["resident", "swap"] = "resident"  # resident: a frozen copy on the device | swap: kept on the host


@dataclass
class LoggingConfig:
    tensorboard: bool = True  # also write metrics to <exp_dir>/tensorboard
    samples_every: int = 5  # write decoded samples every N steps (0 = never)
    num_samples: int = 4  # samples written each time
    progress_bar: bool = True  # a progress bar on the logging rank


@dataclass
class ActorCheckpointConfig(CheckpointConfig):
    save_every: int = 0  # steps between checkpoints (0 = only at the end / on SIGTERM / max_time)
    save_critic: bool = True  # the critic job checkpoints the same step (critic_save)
    save_at_end: bool = True  # checkpoint after the last step


@dataclass
class ValidationConfig:
    every: int = 0  # steps between validations (0 = never)
    greedy: bool = True  # greedy responses for validation (else sampled as in training)
    max_prompts: int = 64  # validate on the first N prompts of data.val_file


@dataclass
class ActorJobConfig:
    MODEL_SECTIONS: ClassVar[tuple[str, ...]] = ("model",)  # filled from their checkpoint's model.yaml at load
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy (and the reference: its initial weights)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how the policy is split over the ranks
    optim: OptimConfig = field(default_factory=OptimConfig)  # the policy's optimizer
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # the engine that samples responses
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how response tokens are drawn
    ppo: PPOConfig = field(default_factory=PPOConfig)  # batch sizes and the PPO loss
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
        p, s, k = self.ppo, self.sampling, self.ppo.kl
        for key in ("num_steps", "rollout_batch_size", "num_mini_batches", "micro_batch_size", "epochs"):
            check(getattr(p, key) >= 1, f"ppo.{key}", f"must be >= 1, got {getattr(p, key)}")
        check(
            p.forward_micro_batch_size is None or p.forward_micro_batch_size >= 1,
            "ppo.forward_micro_batch_size",
            f"must be >= 1 (or null), got {p.forward_micro_batch_size}",
        )
        check(0 < p.clip_eps < 1, "ppo.clip_eps", f"must be in (0, 1), got {p.clip_eps}")
        check(
            p.clip_eps_high is None or 0 < p.clip_eps_high < 10,
            "ppo.clip_eps_high",
            f"must be in (0, 10) (or null), got {p.clip_eps_high}",
        )
        check(p.dual_clip is None or p.dual_clip > 1, "ppo.dual_clip", f"must be > 1 (or null), got {p.dual_clip}")
        check(0 <= p.gamma <= 1, "ppo.gamma", f"must lie in [0, 1], got {p.gamma}")
        check(0 <= p.lam <= 1, "ppo.lam", f"must lie in [0, 1], got {p.lam}")
        check(math.isfinite(k.coef) and k.coef >= 0, "ppo.kl.coef", f"must be a finite number >= 0, got {k.coef}")
        check(p.critic_warmup_steps >= 0, "ppo.critic_warmup_steps", "must be >= 0")
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
        if (per_rank // p.num_mini_batches) % p.micro_batch_size:
            raise ConfigError(
                "ppo.micro_batch_size",
                f"a mini-batch of {per_rank // p.num_mini_batches} rollouts per data-parallel rank is "
                f"not divisible by ppo.micro_batch_size={p.micro_batch_size}",
            )
        return dp

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.data.tokenizer or self.model.tokenizer

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.exp_dir, "checkpoints")

    def resolve_paths(self, config_dir: Optional[str] = None) -> None:
        self.data.train_file = resolve_file(self.data.train_file, "data.train_file", config_dir)
        self.data.val_file = resolve_file(self.data.val_file, "data.val_file", config_dir)
        if self.data.tokenizer is not None:
            self.data.tokenizer = resolve_file(self.data.tokenizer, "data.tokenizer", config_dir)
        elif self.model.tokenizer is not None:
            self.model.tokenizer = resolve_file(self.model.tokenizer, "model.tokenizer", config_dir)
        else:
            raise ConfigError(
                "data.tokenizer",
                "set data.tokenizer or model.tokenizer (a tokenizer.json or an HF "
                "tokenizer directory): prompts are tokenised and responses decoded",
            )
        if self.model.checkpoint is not None:
            self.model.checkpoint = resolve_file(self.model.checkpoint, "model.checkpoint", config_dir)


def load_actor_config(argv: Sequence[str], default_name: str = "ppo_actor") -> ActorJobConfig:
    config_dir, name, overrides = parse_cli(argv, default_name)
    cfg = load_config(ActorJobConfig, name, overrides, config_dir)
    cfg.resolve_paths(config_dir or REPO_CONF_DIR)
    return cfg
