"""Where config paths point: `resolve_file(path, key, config_dir)` makes a relative path absolute, looking in the
working directory, the repository root, then `config_dir`; a path found nowhere is a ConfigError naming the key.
`JobPaths` is what every training job's config shares (the actor's, the supervised trainers'): its data files,
tokenizer, starting checkpoint and checkpoint directory.
`resolve_function(spec, key, config_dir)` does the same for a reward function's `path.py[:name]`, whose syntax lives
here (`split_spec`), under both jobs' configs and aligner.rewards.function, which loads it."""

from __future__ import annotations

import os
from typing import Optional

from aligner.config.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_FUNCTION = "reward_fn"  # the function a `path.py` spec without `:name` names


def resolve_file(path: Optional[str], key: str, config_dir: Optional[str] = None) -> Optional[str]:
    if path is None:
        return None
    if os.path.isabs(path):
        candidates = [path]
    else:
        candidates = [os.path.abspath(path), os.path.join(REPO_ROOT, path)]
        if config_dir:
            candidates.append(os.path.join(os.path.abspath(config_dir), path))
    for candidate in candidates:
        if os.path.exists(candidate):
            return os.path.normpath(candidate)
    raise ConfigError(key, f"{path!r} not found (looked in: {', '.join(dict.fromkeys(candidates))})")


def split_spec(spec: str) -> tuple[str, str]:
    """`path.py[:name]` -> (path, name)."""
    path, sep, name = spec.rpartition(":")
    return (path, name) if sep and path and name.isidentifier() else (spec, DEFAULT_FUNCTION)


def resolve_function(spec: Optional[str], key: str, config_dir: Optional[str] = None) -> Optional[str]:
    """`path.py[:name]` -> `abs_path.py:name`: the path resolved as `resolve_file` does, the name made explicit."""
    if spec is None:
        return None
    path, name = split_spec(spec)
    if not path.endswith(".py"):
        raise ConfigError(key, f"must name a Python file, path.py or path.py:function; got {spec!r}")
    path = resolve_file(path, key, config_dir)
    return f"{path}:{name}"


class JobPaths:
    """Mixin of a job config with `data` (train_file, val_file, tokenizer), `model` (tokenizer, checkpoint),
    `checkpoint.dir` and `exp_dir`."""

    @property
    def tokenizer_path(self) -> Optional[str]:
        return self.data.tokenizer or self.model.tokenizer

    @property
    def checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.exp_dir, "checkpoints")

    def resolve_paths(self, config_dir: Optional[str] = None) -> None:
        """Make the data, tokenizer and checkpoint paths absolute (ConfigError naming the key if one is missing)."""
        self.data.train_file = resolve_file(self.data.train_file, "data.train_file", config_dir)
        self.data.val_file = resolve_file(self.data.val_file, "data.val_file", config_dir)
        if self.data.tokenizer is not None:
            self.data.tokenizer = resolve_file(self.data.tokenizer, "data.tokenizer", config_dir)
        elif self.model.tokenizer is not None:
            self.model.tokenizer = resolve_file(self.model.tokenizer, "model.tokenizer", config_dir)
        else:
            raise ConfigError(
                "data.tokenizer",
                "set data.tokenizer or model.tokenizer (a tokenizer.json or an HF tokenizer directory): prompts are "
                "tokenised and responses decoded",
            )
        if self.model.checkpoint is not None:
            self.model.checkpoint = resolve_file(self.model.checkpoint, "model.checkpoint", config_dir)
