"""Config schema (dataclasses), YAML loading with overrides, validation errors that name the key."""

from aligner.config.errors import ConfigError
from aligner.config.generation import GenerationConfig, validate_generation
from aligner.config.loader import load_config, parse_cli, to_yaml
from aligner.config.schema import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    validate_batch,
    validate_layout,
    validate_model,
)

__all__ = [
    "ConfigError",
    "load_config",
    "CheckpointConfig",
    "GenerationConfig",
    "parse_cli",
    "to_yaml",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "validate_batch",
    "validate_generation",
    "validate_layout",
    "validate_model",
]
