"""A user's reward function, named by `path.py` or `path.py:name` (default name `reward_fn`). Imports no torch.

The interface (docs/REWARDS.md): `reward_fn(prompts: list[str], responses: list[str], labels: list[str | None])
-> list[float]`, one finite float (in float32) per sample; `labels` is passed when the function accepts it (or
**kwargs). It must be importable in a fresh process (the actor runs it in worker processes) and deterministic if
runs are to be reproducible.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Callable

from aligner.config.paths import split_spec  # the spec's syntax: the configs of both jobs check it at load


class RewardFunctionError(RuntimeError):
    """A reward function could not be loaded, failed, hung, exited or returned something other than one finite
    float32 per sample. The message names the function and, for a failed call, the sample."""


def load_function(spec: str) -> Callable:
    """Import the file of `spec` under a private module name and return the function it names."""
    path, name = split_spec(spec)
    module_name = "aligner_reward_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise RewardFunctionError(f"reward function {spec}: cannot import {path} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException as exc:  # noqa: BLE001 - a SystemExit at import is also the file's fault
        raise RewardFunctionError(f"reward function {spec}: importing {path} failed: {exc!r}") from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec}: {path} defines no callable {name}(prompts, responses, ...)")
    return fn


def accepts_labels(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call(fn: Callable, takes_labels: bool, prompts: list, responses: list, labels: list) -> list:
    """One call of the user's function with the interface's arguments."""
    return fn(prompts, responses, labels=labels) if takes_labels else fn(prompts, responses)
