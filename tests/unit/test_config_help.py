"""`--help` of the job scripts: every config key of the schema, its value and a one-line description (the field's
trailing comment), exit 0; built by aligner.config.help from any dataclass schema."""

import dataclasses
import os
import re
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from typing import Literal, Optional

import pytest

from aligner.config.actor import ActorJobConfig
from aligner.config.critic import CriticJobConfig
from aligner.config.help import config_help, config_keys, wants_help

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leaf_keys(schema, prefix=""):
    """Every leaf key of a dataclass schema, walked here independently of aligner.config.help."""
    out = []
    for f in dataclasses.fields(schema):
        tp = typing.get_type_hints(schema)[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = args[0] if typing.get_origin(tp) is typing.Union and len(args) == 1 else tp
        if dataclasses.is_dataclass(inner):
            out += leaf_keys(inner, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


@dataclass
class Inner:
    """An inner section. More words."""

    depth: int = 3  # how deep
    mark: str = "#"  # a '#' inside a default is not the comment
    choice: Literal["a", "b"] = "a"
    spread: dict = field(  # the comment where the statement ends wins
        default_factory=dict
    )  # spread over lines


@dataclass
class Base:
    inherited: float = 0.5  # from the base class


@dataclass
class Toy(Base):
    inner: Inner = field(default_factory=Inner)
    maybe: Optional[Inner] = None  # an optional section
    plain: Optional[int] = None

    def method(self):
        local: int = 1  # not a field
        return local


def test_keys_types_defaults_and_comments_of_a_schema():
    keys = {k.key: k for k in config_keys(Toy)}
    assert list(keys) == [
        "inherited",
        "inner",
        "inner.depth",
        "inner.mark",
        "inner.choice",
        "inner.spread",
        "maybe",
        "maybe.depth",
        "maybe.mark",
        "maybe.choice",
        "maybe.spread",
        "plain",
    ]
    assert keys["inherited"].description == "from the base class"
    assert keys["inner"].section and keys["inner"].description == "An inner section"  # the class docstring
    assert keys["maybe"].type == "section|null" and keys["maybe"].description == "an optional section"
    assert (keys["inner.depth"].type, keys["inner.depth"].default, keys["inner.depth"].description) == (
        int.__name__,
        3,
        "how deep",
    )
    assert keys["inner.mark"].description == "a '#' inside a default is not the comment"
    assert keys["inner.choice"].type == "a|b" and keys["inner.choice"].description == ""
    assert keys["inner.spread"].description == "the comment where the statement ends wins"
    assert keys["plain"].type == "int|null" and keys["plain"].description == ""
    assert wants_help(["a=1", "--help"]) and wants_help(["-h"]) and not wants_help(["help=1"])


@pytest.mark.parametrize("schema", [ActorJobConfig, CriticJobConfig])
def test_every_key_of_the_job_schemas_has_a_description(schema):
    keys = config_keys(schema)
    assert [k.key for k in keys if not k.section] == leaf_keys(schema)
    assert [k.key for k in keys if not k.description] == [], "add a trailing # comment to these fields"


@pytest.mark.parametrize(
    "script, schema, config",
    [
        ("train_ppo_actor.py", ActorJobConfig, "ppo_actor_demo"),
        ("serve_ppo_critic.py", CriticJobConfig, "ppo_critic_demo"),
    ],
)
def test_help_of_the_job_scripts_lists_every_key_with_its_value(script, schema, config):
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", script), "--config-name", config, "seed=7", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0 and not run.stderr, run.stderr
    lines = {
        m.group(1): (m.group(2), m.group(3)) for m in re.finditer(r"^  (\S+) += (.*?) +\((\S+)\)", run.stdout, re.M)
    }
    assert list(lines) == leaf_keys(schema)
    assert lines["seed"][0] == "7", "the value a run would use: file and overrides applied"
    assert lines["model.vocab_size"][0] == "48", f"conf/{config}.yaml's value"
    assert lines["parallel.backend"] == ("auto", "auto|nccl|gloo")
    assert "srun -n" in run.stdout, "the script's own docstring comes first"


def test_help_shows_the_schema_defaults_when_the_config_cannot_be_read():
    text = config_help(ActorJobConfig, ["--config-name", "no_such_config"], "ppo_actor")
    assert "values: the schema's defaults (the config could not be read" in text
    assert re.search(r"^  ppo.num_steps += 100 ", text, re.M)
