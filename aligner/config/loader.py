"""YAML -> OmegaConf -> typed dataclass, with Hydra-style command lines.

Command line: `[--config-path DIR] [--config-name NAME] [key.sub=value ...]` (also `--config-name=NAME`).
A YAML file may start from others with `defaults: [base_name, ...]` (names in the same directory, merged in order,
then the file itself on top), so recipes hold only their differences from a base.
Merging onto the dataclass schema rejects unknown keys and values of the wrong type; the error names the key.
"""

from __future__ import annotations

import os
from dataclasses import is_dataclass
from typing import Sequence, Type, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner.config.errors import ConfigError

T = TypeVar("T")

REPO_CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")


def parse_cli(argv: Sequence[str], default_name: str) -> tuple[str | None, str, list[str]]:
    """Split argv into (config dir or None, config name, overrides)."""
    config_dir, name, overrides = None, default_name, []
    args = list(argv)
    while args:
        arg = args.pop(0)
        for flag in ("--config-name", "--config-path", "-cn", "-cp"):
            if arg == flag or arg.startswith(flag + "="):
                if "=" in arg:
                    value = arg.split("=", 1)[1]
                elif args:
                    value = args.pop(0)
                else:
                    raise ConfigError(flag, "needs a value")
                if flag in ("--config-name", "-cn"):
                    name = value
                else:
                    config_dir = value
                break
        else:
            if arg in ("-h", "--help"):
                raise SystemExit(
                    "usage: [--config-path DIR] [--config-name NAME] [key.sub=value ...]\n"
                    f"configs live in {REPO_CONF_DIR} by default"
                )
            if "=" not in arg or arg.startswith("-"):
                raise ConfigError(arg, "command-line overrides are written key.sub=value")
            overrides.append(arg)
    return config_dir, name, overrides


def _resolve_path(name: str, config_dir: str | None) -> str:
    if name.endswith((".yaml", ".yml")) and os.path.exists(name):
        return name
    config_dir = config_dir or REPO_CONF_DIR
    for candidate in (os.path.join(config_dir, name), os.path.join(config_dir, name + ".yaml")):
        if os.path.isfile(candidate):
            return candidate
    available = []
    if os.path.isdir(config_dir):
        available = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml"))
    raise ConfigError("--config-name", f"no config {name!r} in {config_dir} (available: {', '.join(available)})")


def _load_yaml_with_defaults(path: str, seen: tuple = ()) -> DictConfig:
    if path in seen:
        raise ConfigError("defaults", f"circular defaults: {' -> '.join(seen + (path,))}")
    try:
        node = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - YAML syntax errors come in several types
        raise ConfigError(path, f"cannot parse YAML: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(path, "the top level of a config file must be a mapping")
    bases = node.pop("defaults", None) or []
    merged = OmegaConf.create()
    for base in bases:
        if base == "_self_":
            continue
        merged = OmegaConf.merge(
            merged, _load_yaml_with_defaults(_resolve_path(str(base), os.path.dirname(path)), seen + (path,))
        )
    return OmegaConf.merge(merged, node)


def _wrap(exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    msg = str(exc).split("\n")[0]
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        msg = f"unknown key ({msg}); check the spelling against the schema in aligner/config"
    return ConfigError(key, msg)


def load_config(schema: Type[T], name: str, overrides: Sequence[str] = (), config_dir: str | None = None) -> T:
    """Build a `schema` instance from conf/<name>.yaml plus `key=value` overrides."""
    if not is_dataclass(schema):
        raise TypeError("schema must be a dataclass type")
    base = OmegaConf.structured(schema)
    file_cfg = _load_yaml_with_defaults(_resolve_path(name, config_dir))
    try:
        merged = OmegaConf.merge(base, file_cfg)
        for item in overrides:
            key, _, _ = item.partition("=")
            try:
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
            except OmegaConfBaseException as exc:
                raise ConfigError(key, f"bad override {item!r}: {str(exc).splitlines()[0]}") from exc
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _wrap(exc) from exc
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def load_from_argv(schema: Type[T], argv: Sequence[str], default_name: str) -> T:
    config_dir, name, overrides = parse_cli(argv, default_name)
    return load_config(schema, name, overrides, config_dir)


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
