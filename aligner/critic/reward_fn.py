"""Rewards from a Python function instead of a reward model (verifiable rewards, the CPU demo).

Contract of the user's file: it defines `reward_fn(prompts: list[str], responses: list[str], ...) -> list[float]`
with one finite float per sample. If the function accepts a `labels` argument (or **kwargs) it receives
`labels: list[str | None]` (the optional `labels` input of critic_infer, None where absent).
Text comes from decoding tokens with the job's tokenizer, special tokens skipped: the prompt is
`tokens[:prompt_length]`, the response `tokens[prompt_length:length]` (the whole sequence without prompt_lengths).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Callable, Sequence

import numpy as np


class RewardFunctionError(RuntimeError):
    """The reward function failed or returned something other than one finite float per sample."""


def load_tokenizer_decode(path: str) -> Callable[[Sequence[int]], str]:
    """A `decode(ids) -> str` from a tokenizer.json file (tokenizers) or an HF tokenizer directory (transformers)."""
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return lambda ids: tok.decode(list(ids), skip_special_tokens=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def load_reward_fn(path: str) -> Callable:
    """Import `path` as a module (under a private name) and return its `reward_fn`."""
    name = "aligner_user_reward_" + str(abs(hash(os.path.abspath(path))))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"reward_fn={path}: cannot import this file as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardFunctionError(f"reward_fn={path}: importing it failed: {exc!r}") from exc
    fn = getattr(module, "reward_fn", None)
    if not callable(fn):
        raise RewardFunctionError(f"reward_fn={path} defines no callable `reward_fn(prompts, responses, ...)`")
    return fn


def _accepts_labels(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "labels" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class RewardFunction:
    """`reward_fn` from a file plus the tokenizer that turns token rows back into prompt/response text."""

    def __init__(self, path: str, tokenizer_path: str):
        self.path = path
        self.fn = load_reward_fn(path)
        self.decode = load_tokenizer_decode(tokenizer_path)
        self.takes_labels = _accepts_labels(self.fn)

    def texts(self, tokens_BT: np.ndarray, lengths_B: np.ndarray, prompt_lengths_B: np.ndarray | None):
        prompts, responses = [], []
        for b in range(tokens_BT.shape[0]):
            start = int(prompt_lengths_B[b]) if prompt_lengths_B is not None else 0
            row = tokens_BT[b, : int(lengths_B[b])].tolist()
            prompts.append(self.decode(row[:start]) if start else "")
            responses.append(self.decode(row[start:]))
        return prompts, responses

    def __call__(
        self,
        tokens_BT: np.ndarray,
        lengths_B: np.ndarray,
        prompt_lengths_B: np.ndarray | None = None,
        labels: list | None = None,
    ) -> np.ndarray:
        """Rewards float32 [B] for the rows of `tokens_BT`."""
        prompts, responses = self.texts(tokens_BT, lengths_B, prompt_lengths_B)
        try:
            if self.takes_labels:
                scores = self.fn(prompts, responses, labels=labels if labels is not None else [None] * len(prompts))
            else:
                scores = self.fn(prompts, responses)
        except BaseException as exc:  # SystemExit too: user code must not stop (or hang) the critic job
            if isinstance(exc, KeyboardInterrupt):
                raise
            what = f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"raised {exc!r}"
            raise RewardFunctionError(f"reward_fn in {self.path} {what}") from exc
        try:
            scores = [float(s) for s in scores]
        except (TypeError, ValueError) as exc:
            raise RewardFunctionError(
                f"reward_fn in {self.path} must return a list of floats, got {type(scores).__name__}: {exc}"
            ) from exc
        if len(scores) != len(prompts):
            raise RewardFunctionError(
                f"reward_fn in {self.path} returned {len(scores)} scores for "
                f"{len(prompts)} samples: return one per sample"
            )
        # Checked in float32, the dtype the rewards are used in: 1e39 is finite as a Python float, inf here.
        rewards = np.asarray(scores, dtype=np.float64).astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(rewards))
        if bad.size:
            i = int(bad[0])
            raise RewardFunctionError(
                f"reward_fn in {self.path} returned {scores[i]} for sample {i} (response {responses[i][:60]!r}), "
                "not a finite float32: return finite scores"
            )
        return rewards
