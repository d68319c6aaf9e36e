"""YAML -> OmegaConf -> typed dataclass, with Hydra-style command lines.

Command line: `[--config-path DIR] [--config-name NAME] [key.sub=value ...] [group=option ...]`.
A YAML file may start from others with `defaults: [...]`, merged in order, then the file itself on top, so recipes
hold only their differences from a base. An entry is either a file name (in the same directory) or a config group
choice: `{model: llama_1b}` merges `<conf>/model/llama_1b.yaml` into the `model` section, and
`{model@reward_model: tiny}` merges `<conf>/model/tiny.yaml` into `reward_model`. The same choice on the command
line: `model=llama_1b` or `model@reward_model=tiny` (a bare name, where `<conf>/<group>/` exists); it is applied
after the files and before the `key=value` overrides.
Merging onto the dataclass schema rejects unknown keys and values of the wrong type; the error names the key.
A schema whose class attribute `MODEL_SECTIONS` names model sections (ModelConfig) gets each of them filled from
its checkpoint's model.yaml (aligner.config.from_checkpoint): under the config file's own keys and the command line
("explicit"), over what `defaults:` brought in.
"""

from __future__ import annotations

import os
import re
from dataclasses import is_dataclass
from typing import Sequence, Type, TypeVar

import omegaconf
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner.config.errors import ConfigError
from aligner.config.from_checkpoint import fill_from_checkpoint

T = TypeVar("T")

OMEGACONF_MIN = (2, 4)  # the schemas' Literal-typed fields: omegaconf 2.3 rejects them


def omegaconf_too_old(version: str) -> str | None:
    """Why an installed omegaconf of `version` cannot read aligner's schemas (None if it can)."""
    major_minor = re.match(r"(\d+)\.(\d+)", version)
    if major_minor and tuple(map(int, major_minor.groups())) >= OMEGACONF_MIN:
        return None
    return (
        f"omegaconf {version} is installed, but aligner's configs need omegaconf>=2.4 (2.3 rejects their "
        "Literal-typed fields): pip install 'omegaconf>=2.4'"
    )


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


def _group_folder(group: str, config_dir: str | None) -> str:
    """Where group `group` lives: beside the config (or one level up, for recipes in conf/bench/), else conf/."""
    for base in (config_dir, os.path.dirname(config_dir) if config_dir else None, REPO_CONF_DIR):
        if base and os.path.isdir(os.path.join(base, group)):
            return os.path.join(base, group)
    return os.path.join(REPO_CONF_DIR, group)


def _group_choice(spec: str, option: str, config_dir: str | None) -> DictConfig:
    """`<group>[@dest]` = `option` as a config placed at `dest` (default: the group's name)."""
    group, _, dest = spec.partition("@")
    dest = dest or group
    folder = _group_folder(group, config_dir)
    path = os.path.join(folder, f"{option}.yaml")
    if not os.path.isfile(path):
        options = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []
        raise ConfigError(dest, f"no option {option!r} in config group {group!r} (choose from: {', '.join(options)})")
    body = _load_yaml_with_defaults(path)
    return OmegaConf.create({dest: body})


def is_group_choice(item: str, config_dir: str | None) -> bool:
    """`model=llama_1b` (a config group choice) rather than `model.lr=...` or `model=null` (a value: no section)."""
    key, eq, value = item.partition("=")
    if not eq or "." in key.partition("@")[0] or "/" in value or "." in value or value in ("null", "~"):
        return False
    return os.path.isdir(_group_folder(key.partition("@")[0], config_dir))


def _load_yaml_with_defaults(path: str, seen: tuple = ()) -> DictConfig:
    defaults, body = _load_yaml_parts(path, seen)
    return OmegaConf.merge(defaults, body)


def _load_yaml_parts(path: str, seen: tuple = ()) -> tuple[DictConfig, DictConfig]:
    """(what the file's `defaults:` list brings, merged in order; the file's own keys)."""
    if path in seen:
        raise ConfigError("defaults", f"circular defaults: {' -> '.join(seen + (path,))}")
    try:
        with open(path, encoding="utf-8") as f:
            node = OmegaConf.create(_words_as_written(f.read()) or "{}")
    except Exception as exc:  # noqa: BLE001 - YAML syntax errors come in several types
        raise ConfigError(path, f"cannot parse YAML: {exc}") from exc
    if not isinstance(node, DictConfig):
        raise ConfigError(path, "the top level of a config file must be a mapping")
    bases = node.pop("defaults", None) or []
    merged = OmegaConf.create()
    for base in bases:
        if base == "_self_":
            continue
        if isinstance(base, DictConfig):
            for spec, option in base.items():
                merged = OmegaConf.merge(merged, _group_choice(str(spec), str(option), os.path.dirname(path)))
            continue
        merged = OmegaConf.merge(
            merged, _load_yaml_with_defaults(_resolve_path(str(base), os.path.dirname(path)), seen + (path,))
        )
    return merged, node


# YAML 1.1 (PyYAML, so OmegaConf) reads these words as booleans; the choices `auto|on|off` (model.rope_fusion,
# generation.share_weights, ...) mean the words. They are read as written (YAML 1.2: only true/false are booleans);
# a bool field still takes them, converted by OmegaConf ("off" -> False).
_YAML11_WORDS = r"(?:on|On|ON|off|Off|OFF|yes|Yes|YES|no|No|NO)"


def _words_as_written(text: str) -> str:
    """A YAML text with each mapping value that is one of those bare words quoted."""
    pattern = rf"^([^#\n]*:[ \t]+)({_YAML11_WORDS})([ \t]*(?:#.*)?)$"
    return re.sub(pattern, lambda m: f"{m.group(1)}'{m.group(2)}'{m.group(3)}", text, flags=re.M)


def _override_as_written(item: str) -> str:
    """`key=off` as `key='off'` (see _YAML11_WORDS); other overrides unchanged."""
    key, sep, value = item.partition("=")
    return f"{key}='{value}'" if sep and re.fullmatch(_YAML11_WORDS, value) else item


def _explain(msg: str) -> str:
    """OmegaConf's first error line, in our words where we have better ones."""
    choice = re.match(r"Invalid value '(.*)', expected one of \[(.*)\]", msg)
    if choice:
        return f"must be one of {choice.group(2).replace(chr(39), '')}; got {choice.group(1)!r}"
    if "not in struct" in msg or "Key '" in msg and "not in" in msg:
        return f"unknown key ({msg}); check the spelling against the schema in aligner/config"
    return msg


def _wrap(exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    return ConfigError(key, _explain(str(exc).split("\n")[0]))


def merged_config(
    schema: Type[T], name: str, overrides: Sequence[str] = (), config_dir: str | None = None
) -> tuple[DictConfig, str]:
    """The schema with conf/<name>.yaml, group choices and `key=value` overrides merged on top (not yet validated),
    and the config file's path."""
    if not is_dataclass(schema):
        raise TypeError("schema must be a dataclass type")
    too_old = omegaconf_too_old(omegaconf.__version__)
    if too_old:
        raise ConfigError("omegaconf", too_old)
    base = OmegaConf.structured(schema)
    path = _resolve_path(name, config_dir)
    defaults_cfg, body = _load_yaml_parts(path)
    choices = [o for o in overrides if is_group_choice(o, config_dir)]
    overrides = [o for o in overrides if o not in choices]
    explicit = body  # the file's own keys and the command line, untyped: which keys the user wrote
    try:
        merged = OmegaConf.merge(base, defaults_cfg, body)
        for item in choices:
            spec, _, option = item.partition("=")
            choice = _group_choice(spec, option, config_dir)
            merged, explicit = OmegaConf.merge(merged, choice), OmegaConf.merge(explicit, choice)
        for item in overrides:
            key, _, _ = item.partition("=")
            try:
                node = OmegaConf.from_dotlist([_override_as_written(item)])
                merged, explicit = OmegaConf.merge(merged, node), OmegaConf.merge(explicit, node)
            except OmegaConfBaseException as exc:
                raise ConfigError(key, f"bad override {item!r}: {_explain(str(exc).splitlines()[0])}") from exc
        sections = getattr(schema, "MODEL_SECTIONS", ())
        if sections:
            merged = fill_from_checkpoint(merged, explicit, sections, config_dir or REPO_CONF_DIR)
    except OmegaConfBaseException as exc:
        raise _wrap(exc) from exc
    return merged, path


def load_config(schema: Type[T], name: str, overrides: Sequence[str] = (), config_dir: str | None = None) -> T:
    """Build a `schema` instance from conf/<name>.yaml plus `key=value` overrides, and validate it."""
    merged, _ = merged_config(schema, name, overrides, config_dir)
    try:
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _wrap(exc) from exc
    validate = getattr(obj, "validate", None)
    if callable(validate):
        validate()
    return obj


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
