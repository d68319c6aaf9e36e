"""What the supervised trainers' configs share (SFT `conf/sft.yaml`, reward model `conf/reward_model.yaml`, DPO
`conf/dpo.yaml`): the model, parallel, optim and checkpoint sections every job has, plus the training loop
(`train`), the dataset basics (`data`) and logging.

Batch vocabulary: one optimizer step consumes `train.global_batch_size` examples (SFT samples, preference pairs) of
the whole job, split evenly over data-parallel ranks; each rank runs them as micro-batches of
`train.micro_batch_size` (SFT with packing: packed rows of `data.max_length` tokens; RM and DPO: pairs, i.e. twice
as many sequences). `train.max_steps` bounds the run; unset, it is `train.max_epochs` passes over the training file.
Each trainer's schema (aligner/config/{sft,reward_model,dpo}.py) adds its own `data` fields and sections.
`validate()` runs at load; `validate_world(world_size)` once the number of ranks is known.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from aligner.config.errors import ConfigError
from aligner.config.paths import JobPaths
from aligner.config.rules import check, check_choices
from aligner.config.schema import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ProfiledLoggingConfig,
    validate_batch,
    validate_checkpoint,
    validate_layout,
    validate_model,
    validate_optim,
    validate_profiling,
)


@dataclass
class TrainLoopConfig:
    max_steps: Optional[int] = None  # optimizer steps; None = max_epochs passes over data.train_file
    max_epochs: int = 1
    global_batch_size: int = 64  # examples per optimizer step, whole job
    micro_batch_size: int = 4  # examples (SFT with packing: packed rows) per forward/backward on each DP rank
    val_every: int = 0  # steps between validations (0 = never; the last step always validates when there is data)
    val_micro_batch_size: Optional[int] = None  # None = micro_batch_size
    val_max_examples: Optional[int] = None  # None = the whole data.val_file


@dataclass
class TrainDataConfig:
    """Rows are read with aligner.data.rows (JSONL today). A row is either plain text (`prompt` and the trainer's
    response fields) or a chat (`messages`, rendered with the tokenizer's chat template)."""

    train_file: Optional[str] = None  # required
    val_file: Optional[str] = None
    tokenizer: Optional[str] = None  # None = model.tokenizer; tokenizer.json or an HF tokenizer directory
    max_length: int = 2048  # tokens per sequence (prompt + response); longer rows are bad rows
    bad_rows: Literal["skip", "error"] = "skip"  # skip: report each (file:line) and go on | error: stop at the first
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    add_bos: bool = True  # plain-text rows: prepend BOS (a chat template writes its own)
    add_eos: bool = True  # plain-text rows: append EOS after the response (the model learns to stop)
    shuffle: bool = True
    seed: int = 1234


@dataclass
class TrainCheckpointConfig(CheckpointConfig):
    save_every: int = 0  # steps between checkpoints (0 = only at the end / on SIGTERM / max_time)
    save_at_end: bool = True


@dataclass
class TrainLoggingConfig(ProfiledLoggingConfig):
    tensorboard: bool = True
    progress_bar: bool = True


@dataclass
class TrainJobConfig(JobPaths):
    """Base of the three trainers' schemas; each subclass declares its own `data` section (a TrainDataConfig)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    data: TrainDataConfig = field(default_factory=TrainDataConfig)
    checkpoint: TrainCheckpointConfig = field(default_factory=TrainCheckpointConfig)
    logging: TrainLoggingConfig = field(default_factory=TrainLoggingConfig)
    exp_dir: str = "results/train"  # metrics.jsonl, TensorBoard, checkpoints
    seed: int = 1234
    max_time: Optional[float] = None  # seconds; checkpoint and stop cleanly once exceeded

    def validate(self) -> None:
        check_choices(self)
        validate_model(self.model)
        validate_optim(self.optim)
        validate_checkpoint(self.checkpoint)
        validate_profiling(self.logging)
        t, d = self.train, self.data
        check(t.max_steps is None or t.max_steps >= 1, "train.max_steps", "must be >= 1 (or null: max_epochs)")
        for key in ("max_epochs", "global_batch_size", "micro_batch_size"):
            check(getattr(t, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
        check(t.val_every >= 0, "train.val_every", "must be >= 0")
        for key in ("val_micro_batch_size", "val_max_examples"):
            value = getattr(t, key)
            check(value is None or value >= 1, f"train.{key}", f"must be >= 1 (or null), got {value}")
        check(d.train_file is not None, "data.train_file", "is required (a .jsonl file of training rows)")
        check(d.max_length >= 2, "data.max_length", f"must be >= 2, got {d.max_length}")
        check(
            d.max_length <= self.model.max_position_embeddings,
            "data.max_length",
            f"{d.max_length} exceeds model.max_position_embeddings={self.model.max_position_embeddings}",
        )
        check(self.checkpoint.save_every >= 0, "checkpoint.save_every", "must be >= 0")
        check(
            self.max_time is None or (math.isfinite(self.max_time) and self.max_time > 0),
            "max_time",
            "must be > 0 seconds (or null)",
        )

    def validate_world(self, world_size: int) -> int:
        """Layout and batch divisibility on `world_size` ranks; returns the data-parallel size."""
        dp = validate_layout(self.model, self.parallel, world_size)
        t = self.train
        if t.global_batch_size % dp:
            raise ConfigError(
                "train.global_batch_size", f"{t.global_batch_size} is not divisible by the data-parallel size {dp}"
            )
        if not self.packs_rows:  # packed rows are a different unit: any number of them per rank is fine
            validate_batch(
                t.global_batch_size, t.micro_batch_size, dp, "train.global_batch_size", "train.micro_batch_size"
            )
        return dp

    @property
    def packs_rows(self) -> bool:
        """True when micro-batches count packed rows rather than examples (SFT with packing)."""
        return False


def load_train_config(schema: type, argv, default_name: str):
    """`[--config-path DIR] [--config-name NAME] [key=value ...]` -> a validated `schema` instance, paths resolved."""
    from aligner.config.loader import REPO_CONF_DIR, load_config, parse_cli

    config_dir, name, overrides = parse_cli(argv, default_name)
    cfg = load_config(schema, name, overrides, config_dir)
    cfg.resolve_paths(config_dir or REPO_CONF_DIR)
    return cfg


__all__ = [
    "TrainCheckpointConfig",
    "TrainDataConfig",
    "TrainJobConfig",
    "TrainLoggingConfig",
    "TrainLoopConfig",
    "load_train_config",
]
