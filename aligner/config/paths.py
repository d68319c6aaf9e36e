"""Where config paths point: `resolve_file(path, key, config_dir)` makes a relative path absolute, looking in the
working directory, the repository root, then `config_dir`; a path found nowhere is a ConfigError naming the key."""

from __future__ import annotations

import os
from typing import Optional

from aligner.config.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
