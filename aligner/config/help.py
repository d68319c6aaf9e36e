"""`--help` for entry scripts: every key of a config schema with its value and a one-line description.

The schema is the documentation: each field's description is its trailing `# comment` in the dataclass source
(`lr: float = 1e-5  # peak learning rate`), on the line where the field's statement ends; a section (a field whose
type is a dataclass) without one takes the first sentence of its class docstring. `tests/unit/test_config_help.py`
checks that every leaf key of the jobs' schemas has a description, so a new field without one fails CI.

- `wants_help(argv)`: `-h` or `--help` is among the arguments.
- `config_keys(schema)`: `KeyDoc(key, type, default, description)` for every section and leaf, depth first, in field
  order (defaults are the schema's own).
- `config_help(schema, argv, default_name, doc)`: the text to print: the script's docstring, the command-line
  grammar, then every key with its value as the chosen config file (`--config-name`, default `default_name`), group
  choices and overrides in `argv` set it, so `script.py --config-name X --help` shows what a run of X would use.
Loading imports no torch, so `--help` answers in a moment.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import textwrap
import tokenize
import typing
from functools import lru_cache
from typing import Any, NamedTuple, Optional

from aligner.config.errors import ConfigError


class KeyDoc(NamedTuple):
    key: str  # dotted path, e.g. "ppo.kl.coef"
    type: str  # "int", "float|null", "native|trtllm", "section", ...
    default: Any  # the schema default (a leaf), or None for a section
    description: str
    section: bool = False


def wants_help(argv) -> bool:
    return any(a in ("-h", "--help") for a in argv)


@lru_cache(maxsize=None)
def _field_comments(cls: type) -> dict[str, str]:
    """{field name: its trailing comment} for the fields written in `cls`'s own body (`name: type ...  # comment`)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (e.g. a class made at run time): no descriptions
        return {}
    out: dict[str, str] = {}
    depth, first, name, comment = 0, None, None, None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.INDENT, tokenize.DEDENT):
            depth += 1 if tok.type == tokenize.INDENT else -1
        elif tok.type == tokenize.NEWLINE:  # the end of a statement, however many lines it spans
            if name is not None and comment:
                out[name] = comment
            first, name, comment = None, None, None
        elif tok.type == tokenize.COMMENT:
            if name is not None and comment is None:
                comment = tok.string.lstrip("#").strip()
        elif tok.type != tokenize.NL:
            if first is None:
                first = tok if depth == 1 and tok.type == tokenize.NAME else False
            elif first and name is None and tok.string == ":" and tok.start[1] > first.start[1]:
                name, first = first.string, False  # `name:` at the class body's level: an annotated field
            elif first:
                first = False
    return out


def _description(owner: type, field_name: str) -> str:
    for cls in owner.__mro__:
        if field_name in cls.__dict__.get("__annotations__", {}):
            return _field_comments(cls).get(field_name, "")
    return ""


def _section_type(tp) -> Optional[type]:
    """The dataclass type of a section field (also `Optional[Section]`), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def _type_text(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "|".join(str(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return "|".join("null" if a is type(None) else _type_text(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        return origin.__name__
    return getattr(tp, "__name__", str(tp))


def _first_sentence(cls: type) -> str:
    """The first sentence of `cls`'s own docstring (not the signature dataclasses writes when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(cls.__name__ + "("):
        return ""
    text = " ".join(doc.split())
    return text.split(". ")[0].rstrip(".") if text else ""


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def config_keys(schema: type, prefix: str = "") -> list[KeyDoc]:
    """Every section and leaf key of `schema` (a dataclass type), with its schema default and description."""
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        key, tp = prefix + f.name, hints[f.name]
        section = _section_type(tp)
        description = _description(schema, f.name)
        if section is not None:
            description = description or _first_sentence(section)
            out.append(KeyDoc(key, "section" + ("|null" if section is not tp else ""), None, description, True))
            out.extend(config_keys(section, key + "."))
        else:
            out.append(KeyDoc(key, _type_text(tp), _default(f), description))
    return out


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value) if value == "" or value.strip() != value else value
    return str(value)


def _lookup(tree, key: str):
    """(found, value) of dotted `key` in a plain nested dict."""
    node = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _configured_values(schema: type, argv, default_name: str) -> tuple[Optional[dict], str]:
    """The values a run with `argv` would start from (a nested dict), and a line saying where they come from."""
    from omegaconf import OmegaConf

    from aligner.config.loader import merged_config, parse_cli

    args = [a for a in argv if a not in ("-h", "--help")]
    try:
        config_dir, name, overrides = parse_cli(args, default_name)
        merged, path = merged_config(schema, name, overrides, config_dir)
    except ConfigError as exc:
        return None, f"values: the schema's defaults (the config could not be read: {exc})"
    where = os.path.relpath(path) if not os.path.relpath(path).startswith("..") else path
    extra = f" and {len(overrides)} override(s)" if overrides else ""
    return OmegaConf.to_container(merged, resolve=False), f"values: {where}{extra} over the schema's defaults"


def config_help(schema: type, argv, default_name: str, doc: str = "") -> str:
    """The `--help` text of an entry script whose config is `schema` (module docstring)."""
    from aligner.config.loader import REPO_CONF_DIR

    values, source = _configured_values(schema, argv, default_name)
    keys = config_keys(schema)
    width = max(len(k.key) for k in keys)
    lines = [doc.strip(), ""] if doc else []
    lines += [
        "Command line: [--config-path DIR] [--config-name NAME] [group=option ...] [key.sub=value ...]",
        f"  configs: {REPO_CONF_DIR} (default --config-name {default_name}); groups: " + _groups(REPO_CONF_DIR),
        "",
        f"Config keys ({source}; the schema and its comments: {_schema_files(schema)}):",
    ]
    for k in keys:
        found, value = _lookup(values, k.key) if values is not None else (False, None)
        if k.section:
            state = " = null" if found and value is None else ""
            lines.append(f"{k.key}{state}  [{k.description}]" if k.description else f"{k.key}{state}")
            continue
        shown = _show(value if found else k.default)
        lines.append(f"  {k.key:<{width}} = {shown:<12} ({k.type})  {k.description}".rstrip())
    return "\n".join(lines)


def _groups(conf_dir: str) -> str:
    out = []
    for group in sorted(os.listdir(conf_dir)) if os.path.isdir(conf_dir) else []:
        folder = os.path.join(conf_dir, group)
        options = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")) if os.path.isdir(folder) else []
        if options and group != "bench":  # conf/bench/ holds recipes (--config-name bench/NAME), not a group
            out.append(f"{group}={'|'.join(options)}")
    return ", ".join(out) or "none"


def _schema_files(schema: type) -> str:
    mods = []
    for cls in _section_classes(schema):
        mod = inspect.getmodule(cls)
        path = getattr(mod, "__file__", None)
        if path:
            rel = os.path.join("aligner", "config", os.path.basename(path))
            if rel not in mods:
                mods.append(rel)
    return ", ".join(mods)


def _section_classes(schema: type, seen=None) -> list[type]:
    seen = [] if seen is None else seen
    if schema in seen:
        return seen
    seen.append(schema)
    for tp in typing.get_type_hints(schema).values():
        section = _section_type(tp)
        if section is not None:
            _section_classes(section, seen)
    return seen
