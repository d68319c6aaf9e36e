"""Rewards from a Python function instead of a reward model (verifiable rewards, the CPU demo), in the critic job.

The function is the one interface of aligner.rewards.function (docs/REWARDS.md), loaded by its loader: `reward_fn`
names `path.py` or `path.py:name` (default name `reward_fn`); the function takes `(prompts: list[str],
responses: list[str])`, plus `labels: list[str | None]` (critic_infer's optional `labels`, None where absent) when
it accepts `labels` or **kwargs, and returns one finite float per sample. Text comes from decoding tokens with the
job's tokenizer, special tokens skipped: the prompt is `tokens[:prompt_length]`, the response
`tokens[prompt_length:length]` (the whole sequence without prompt_lengths).
Failures raise RewardFunctionError naming the function and, for a bad score, the sample: it raised (sys.exit too:
user code must not stop the critic job), returned something other than one number per sample, or a number that is
not finite in float32 (the dtype rewards are used in). Unlike the actor's RewardPool, the function runs in the
critic's own process: it has no per-call timeout.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from aligner.rewards.function import RewardFunctionError, accepts_labels, call, load_function

__all__ = ["RewardFunction", "RewardFunctionError", "load_tokenizer_decode"]


def load_tokenizer_decode(path: str) -> Callable[[Sequence[int]], str]:
    """A `decode(ids) -> str` from a tokenizer.json file (tokenizers) or an HF tokenizer directory (transformers)."""
    if os.path.isfile(path):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
        return lambda ids: tok.decode(list(ids), skip_special_tokens=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


class RewardFunction:
    """The function of `spec` (`path.py[:name]`) plus the tokenizer that turns token rows back into text."""

    def __init__(self, spec: str, tokenizer_path: str):
        self.spec = spec
        self.fn = load_function(spec)
        self.decode = load_tokenizer_decode(tokenizer_path)
        self.takes_labels = accepts_labels(self.fn)

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
        labels = labels if labels is not None else [None] * len(prompts)
        try:
            out = call(self.fn, self.takes_labels, prompts, responses, labels)
        except BaseException as exc:  # SystemExit too: user code must not stop the critic job
            if isinstance(exc, KeyboardInterrupt):
                raise
            what = f"called sys.exit({exc.code!r})" if isinstance(exc, SystemExit) else f"raised {exc!r}"
            raise RewardFunctionError(f"reward function {self.spec} {what}") from exc
        try:
            scores = [float(s) for s in out]
        except (TypeError, ValueError) as exc:
            raise RewardFunctionError(
                f"reward function {self.spec} must return a list of floats, got {type(out).__name__}: {exc}"
            ) from exc
        if len(scores) != len(prompts):
            raise RewardFunctionError(
                f"reward function {self.spec} returned {len(scores)} scores for {len(prompts)} samples: return one "
                "per sample"
            )
        # Checked in float32, the dtype the rewards are used in: 1e39 is finite as a Python float, inf here.
        with np.errstate(over="ignore", invalid="ignore"):
            rewards = np.asarray(scores, dtype=np.float64).astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(rewards))
        if bad.size:
            i = int(bad[0])
            raise RewardFunctionError(
                f"reward function {self.spec} returned {scores[i]} for sample {i} (prompt {prompts[i][:50]!r}, "
                f"response {responses[i][:60]!r}), not a finite float32: return finite scores"
            )
        return rewards
