"""The critic job's config schema (`conf/ppo_critic.yaml`) and the actor-side `critic` client section.

`CriticJobConfig` composes the shared sections (model, parallel, optim) with the critic job's own: which reward
(a reward model or a reward function, exactly one), how the value model trains, where the PyTriton server
listens, and checkpointing. `model: null` is reward-only mode (`reward_only`): no value model, so the job serves
critic_infer's rewards alone (values: zeros [B, 1]) and binds neither critic_train nor critic_save, for the actor's
critic-free estimators. `validate()` runs at load (rules a type cannot express); `resolve_paths(config_dir)`
turns relative file paths into absolute ones and checks that they exist; `validate_world(world_size)` checks the
layout and batch sizes once the number of ranks is known. `load_critic_config(argv)` does all three but the last.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Sequence

from aligner.config.errors import ConfigError
from aligner.config.loader import REPO_CONF_DIR, load_config, parse_cli
from aligner.config.paths import resolve_file, resolve_function, split_spec
from aligner.config.rules import check_choices
from aligner.config.schema import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    validate_batch,
    validate_checkpoint,
    validate_layout,
    validate_model,
    validate_optim,
)

# Beside model.yaml in a reward-model checkpoint (written by aligner/train/reward_model.py).
REWARD_STATS_FILE = "reward_stats.json"


@dataclass
class CriticTrainConfig:
    """How one `critic_train` request is consumed: `epochs` passes over the request's rows in order, one optimizer
    step per `global_batch_size` rows (the last global batch may be smaller), `micro_batch_size` rows per forward."""

    global_batch_size: int = 64  # rows per optimizer step
    micro_batch_size: int = 4  # rows per forward/backward pass on each data-parallel rank
    micro_batch_tokens: Optional[int] = None  # instead of rows: as many as fit in this many tokens; null = by rows
    epochs: int = 1  # passes over each critic_train request
    value_clip_eps: Optional[float] = 0.2  # None = unclipped value loss


@dataclass
class CriticInferConfig:
    micro_batch_size: int = 8  # rows per forward pass of `critic_infer` on each data-parallel rank
    micro_batch_tokens: Optional[int] = None  # instead of rows: as many as fit in this many tokens; null = by rows


@dataclass
class CriticServerConfig:
    host: str = "127.0.0.1"  # address the server binds to and prints; a Slurm launcher sets the node's host name
    port: int = 5567  # HTTP
    grpc_port: Optional[int] = None  # None = port + 1
    metrics_port: Optional[int] = None  # None = port + 2
    max_batch_size: int = 256  # rows per critic_infer request
    max_train_batch_size: int = 8192  # rows per critic_train request
    max_seq_len: Optional[int] = None  # tokens per row; None = model.max_position_embeddings
    ready_timeout: float = 120.0  # seconds to wait for Triton and the endpoints to answer at start-up
    heartbeat_s: float = 30.0  # idle rank 0 pings the other ranks this often so their collectives never time out
    log_file: Optional[str] = None  # tritonserver's log; None = <exp_dir>/tritonserver.log
    token_file: Optional[str] = None  # the run's secret (else env ALIGNER_CRITIC_TOKEN); required off loopback
    idle_timeout_s: Optional[float] = None  # exit after this long without a request (a dead actor); None: never

    def resolved_ports(self) -> dict[str, int]:
        return {
            "HTTP": self.port,
            "gRPC": self.grpc_port if self.grpc_port is not None else self.port + 1,
            "metrics": self.metrics_port if self.metrics_port is not None else self.port + 2,
        }


@dataclass
class CriticJobConfig:
    MODEL_SECTIONS: ClassVar[tuple[str, ...]] = ("model", "reward_model")  # filled from their checkpoint's model.yaml
    model: Optional[ModelConfig] = field(default_factory=ModelConfig)  # the value model; null: reward-only mode
    reward_model: Optional[ModelConfig] = None  # scalar head read at each sequence's last token
    reward_mean: Optional[float] = None  # scores become (score - mean) / std; null: reward_stats.json of the RM, else 0
    reward_std: Optional[float] = None  # see reward_mean; null: reward_stats.json of the reward model, else 1
    reward_fn: Optional[str] = None  # path.py[:name] (default name reward_fn), as the actor's reward.fn: REWARDS.md
    tokenizer: Optional[str] = None  # decodes tokens for reward_fn (tokenizer.json or an HF tokenizer directory)
    reward_fn_workers: int = 2  # processes (beside rank 0) that run reward_fn; a crashed one is replaced
    reward_fn_timeout: float = 60.0  # seconds one call of reward_fn may take: then critic_infer fails naming it
    reward_fn_samples_per_call: int = 1  # samples per call of reward_fn (a failure names the call's samples)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how both models are split over the ranks
    optim: OptimConfig = field(default_factory=OptimConfig)  # the critic's optimizer
    train: CriticTrainConfig = field(default_factory=CriticTrainConfig)  # how critic_train requests train
    infer: CriticInferConfig = field(default_factory=CriticInferConfig)  # how critic_infer requests run
    server: CriticServerConfig = field(default_factory=CriticServerConfig)  # the PyTriton server
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # the critic's checkpoints
    exp_dir: str = "results/critic"  # the critic's logs and checkpoints
    seed: int = 1234  # seed of initialisation
    trim_padding: int = 64  # micro-batches sorted by length, cut to their longest row rounded up to this (0 = off)

    # -- rules -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        check_choices(self)
        if self.model is not None:
            validate_model(self.model, "model")
        validate_optim(self.optim)
        validate_checkpoint(self.checkpoint)
        if (self.reward_model is None) == (self.reward_fn is None):
            raise ConfigError(
                "reward_model",
                "set exactly one of reward_model (a scalar-head model) or reward_fn "
                "(path.py[:name], a Python reward function); "
                + ("both are set" if self.reward_model is not None else "neither is set"),
            )
        if self.reward_model is not None:
            validate_model(self.reward_model, "reward_model")
            if self.model is not None and self.reward_model.vocab_size != self.model.vocab_size:
                raise ConfigError(
                    "reward_model.vocab_size",
                    f"{self.reward_model.vocab_size} != model.vocab_size="
                    f"{self.model.vocab_size}: both models read the same token ids",
                )
        if self.reward_std is not None and not self.reward_std > 0:
            raise ConfigError("reward_std", f"must be > 0, got {self.reward_std}")
        if self.reward_fn is not None:
            if not split_spec(self.reward_fn)[0].endswith(".py"):
                raise ConfigError("reward_fn", f"must name a Python file (path.py[:name]), got {self.reward_fn!r}")
            if self.tokenizer_path is None:
                raise ConfigError(
                    "tokenizer",
                    "reward_fn scores decoded text: set tokenizer (a tokenizer.json or an "
                    "HF tokenizer directory)" + (" or model.tokenizer" if self.model is not None else ""),
                )
            for key in ("reward_fn_workers", "reward_fn_samples_per_call"):
                if getattr(self, key) < 1:
                    raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
            if not self.reward_fn_timeout > 0:
                raise ConfigError("reward_fn_timeout", f"must be > 0 seconds, got {self.reward_fn_timeout}")
        t, s = self.train, self.server
        for key, value in (
            ("train.global_batch_size", t.global_batch_size),
            ("train.micro_batch_size", t.micro_batch_size),
            ("train.epochs", t.epochs),
            ("infer.micro_batch_size", self.infer.micro_batch_size),
            ("server.max_batch_size", s.max_batch_size),
            ("server.max_train_batch_size", s.max_train_batch_size),
        ):
            if value < 1:
                raise ConfigError(key, f"must be >= 1, got {value}")
        if self.trim_padding < 0:
            raise ConfigError("trim_padding", f"must be >= 0 (0: off), got {self.trim_padding}")
        for key, budget in (("train", t.micro_batch_tokens), ("infer", self.infer.micro_batch_tokens)):
            if budget is not None and budget < 1:
                raise ConfigError(f"{key}.micro_batch_tokens", f"must be >= 1 (or null: by rows), got {budget}")
            if budget is not None and self.parallel.pipeline_model_parallel_size > 1:
                raise ConfigError(
                    f"{key}.micro_batch_tokens",
                    "needs pipeline_model_parallel_size=1 (under PP every micro-batch has one shape); set it to null",
                )
        if t.value_clip_eps is not None and not t.value_clip_eps > 0:
            raise ConfigError("train.value_clip_eps", f"must be > 0 (or null for no clipping), got {t.value_clip_eps}")
        for name, port in s.resolved_ports().items():
            if not 0 < port < 65536:
                raise ConfigError("server.port", f"{name} port {port} is outside 1..65535")
        if len(set(s.resolved_ports().values())) != 3:
            raise ConfigError("server.port", f"HTTP, gRPC and metrics ports must differ: {s.resolved_ports()}")
        first = self.models[0] if self.models else None
        longest = first[1].max_position_embeddings if first else 2**31
        if s.max_seq_len is not None and not 0 < s.max_seq_len <= longest:
            raise ConfigError(
                "server.max_seq_len",
                f"must be in 1..{first[0]}.max_position_embeddings={first[1].max_position_embeddings}, "
                f"got {s.max_seq_len}",
            )
        if first is None and s.max_seq_len is None:
            raise ConfigError("server.max_seq_len", "with neither model nor reward_model, set the longest row accepted")
        if s.idle_timeout_s is not None and not s.idle_timeout_s > 0:
            raise ConfigError("server.idle_timeout_s", f"must be > 0 seconds (or null: never), got {s.idle_timeout_s}")
        if s.ready_timeout <= 0 or s.heartbeat_s <= 0:
            raise ConfigError("server.ready_timeout", "server.ready_timeout and server.heartbeat_s must be > 0")

    def validate_world(self, world_size: int) -> int:
        """Check the TP/PP layout of the models and the batch sizes on `world_size` ranks; returns the DP size."""
        dp = world_size  # no model at all (a reward function alone): every rank is its own slice
        for key, model in self.models:
            dp = validate_layout(model, self.parallel, world_size, key, "parallel")
        if self.reward_only:
            return dp
        validate_batch(
            self.train.global_batch_size,
            self.train.micro_batch_size,
            dp,
            "train.global_batch_size",
            "train.micro_batch_size",
        )
        return dp

    # -- derived values ----------------------------------------------------------------------------------
    @property
    def reward_only(self) -> bool:
        """No value model: critic_infer answers rewards alone; critic_train and critic_save are not served."""
        return self.model is None

    @property
    def models(self) -> list[tuple[str, ModelConfig]]:
        """(key, config) of the models this job builds: the value model, then the reward model."""
        return [(k, m) for k, m in (("model", self.model), ("reward_model", self.reward_model)) if m is not None]

    @property
    def vocab_size(self) -> Optional[int]:
        """The token ids every model of the job can read (None: no model, any id)."""
        return min((m.vocab_size for _, m in self.models), default=None)

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.tokenizer or (self.model.tokenizer if self.model is not None else None)

    @property
    def max_seq_len(self) -> int:
        return self.server.max_seq_len or self.models[0][1].max_position_embeddings

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.exp_dir, "checkpoints")

    def reward_scaling(self) -> tuple[float, float, str]:
        """(mean, std, where from) that standardise reward-model scores: the config's values where set, else those
        stored in `<reward_model.checkpoint>/reward_stats.json` (a checkpoint of scripts/train_reward_model.py),
        else (0, 1)."""
        stored, source = {}, "the config"
        ckpt = self.reward_model.checkpoint if self.reward_model is not None else None
        if ckpt and (self.reward_mean is None or self.reward_std is None):
            path = os.path.join(ckpt, REWARD_STATS_FILE)
            if os.path.isfile(path):
                try:
                    with open(path) as f:
                        stored = json.load(f)
                    stored = {k: float(stored[k]) for k in ("reward_mean", "reward_std")}
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    raise ConfigError("reward_model.checkpoint", f"cannot read {path}: {exc}") from None
                source = path
            elif self.reward_mean is None and self.reward_std is None:
                source = "defaults (no reward_stats.json in reward_model.checkpoint, no reward_mean/reward_std set)"
        mean = self.reward_mean if self.reward_mean is not None else stored.get("reward_mean", 0.0)
        std = self.reward_std if self.reward_std is not None else stored.get("reward_std", 1.0)
        return mean, std, source

    @property
    def triton_log_file(self) -> str:
        return self.server.log_file or os.path.join(self.exp_dir, "tritonserver.log")

    def resolve_paths(self, config_dir: Optional[str] = None) -> None:
        """Make `reward_fn` and `tokenizer` absolute: a relative path is looked up in the working directory, the
        repository root, then `config_dir` (the config file's directory). Raises ConfigError if not found."""
        self.reward_fn = resolve_function(self.reward_fn, "reward_fn", config_dir)
        if self.tokenizer is not None:
            self.tokenizer = resolve_file(self.tokenizer, "tokenizer", config_dir)
        elif self.reward_fn is not None and self.model is not None and self.model.tokenizer is not None:
            self.model.tokenizer = resolve_file(self.model.tokenizer, "model.tokenizer", config_dir)


def load_critic_config(argv: Sequence[str], default_name: str = "ppo_critic") -> CriticJobConfig:
    """`[--config-path DIR] [--config-name NAME] [key=value ...]` -> a validated CriticJobConfig with paths resolved."""
    config_dir, name, overrides = parse_cli(argv, default_name)
    cfg = load_config(CriticJobConfig, name, overrides, config_dir)
    cfg.resolve_paths(config_dir or REPO_CONF_DIR)
    return cfg


@dataclass
class CriticClientConfig:
    """The actor job's `critic` section: where the critic job listens and how long to wait for it."""

    host: str = "127.0.0.1"  # the critic job's address (its server.host)
    port: int = 5567  # the critic job's HTTP port (its server.port)
    connect_timeout: float = 120.0  # seconds to wait for the server to answer before failing with a clear error
    start_timeout: Optional[float] = None  # seconds of the first wait at start-up (null: connect_timeout; see docs)
    infer_timeout: float = 600.0  # seconds for one critic_infer request
    train_timeout: float = 3600.0  # seconds for one critic_train (or critic_save) request
    token_file: Optional[str] = None  # the run's secret (else env ALIGNER_CRITIC_TOKEN; the launchers set it)
    # Both jobs on one GPU: false, so that their kernels take turns instead of time-slicing the GPU
    # (launchers/local/ppo.py sets it there).
    overlap: bool = True  # score and train while the critic job works on its request; false: wait for its answer first

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


__all__ = [
    "CriticJobConfig",
    "CriticTrainConfig",
    "CriticInferConfig",
    "CriticServerConfig",
    "CriticClientConfig",
    "load_critic_config",
    "resolve_file",
    "resolve_function",
]
