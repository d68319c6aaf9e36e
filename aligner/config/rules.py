"""Validation helpers: every config rule raises ConfigError naming the dotted key and what to change.

`check_choices(obj, prefix)` checks every `Literal[...]` field of a dataclass tree in one place (YAML loading checks
them too, through OmegaConf; this also covers configs built in code).
"""

from __future__ import annotations

import typing
from dataclasses import fields, is_dataclass

from aligner.config.errors import ConfigError


def check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def check_choices(obj, prefix: str = "") -> None:
    """Raise ConfigError for a field whose value is not one of its `Literal` choices (recurses into sections)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            check_choices(value, key + ".")
            continue
        choices = _literal_choices(hints.get(f.name))
        if choices is not None and value not in choices:
            raise ConfigError(key, f"must be one of {', '.join(map(str, choices))}; got {value!r}")


def _literal_choices(tp):
    if tp is None:
        return None
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union:  # Optional[Literal[...]]
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is typing.Literal:
                return (*typing.get_args(arg), None)
    return None
