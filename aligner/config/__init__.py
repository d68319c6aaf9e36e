"""Config schema (dataclasses), YAML loading with overrides, validation errors that name the key."""

from aligner.config.errors import ConfigError
from aligner.config.loader import load_config, load_from_argv, parse_cli, to_yaml
from aligner.config.schema import (
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
    "load_from_argv",
    "parse_cli",
    "to_yaml",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "validate_batch",
    "validate_layout",
    "validate_model",
]
