"""Where config paths point: `resolve_file(path, key, config_dir)` makes a relative path absolute, looking in the
working directory, the repository root, then `config_dir`; a path found nowhere is a ConfigError naming the key.
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
