"""Rewards from a Python function instead of a reward model (verifiable rewards, the CPU demo), in the critic job.

The function is the one interface of aligner.rewards.function (docs/REWARDS.md), loaded by its loader: `reward_fn`
names `path.py` or `path.py:name` (default name `reward_fn`); the function takes `(prompts: list[str],
responses: list[str])`, plus `labels: list[str | None]` (critic_infer's optional `labels`, None where absent) when
it accepts `labels` or **kwargs, and returns one finite float per sample. Text comes from decoding tokens with the
job's tokenizer, special tokens skipped: the prompt is `tokens[:prompt_length]`, the response
`tokens[prompt_length:length]` (the whole sequence without prompt_lengths).
The function runs in worker processes (aligner.rewards.pool, as the actor's reward.fn does), started on the
critic's rank 0 only: a call that hangs past `reward_fn_timeout` or crashes its process is killed and replaced, and
every failure raises RewardFunctionError naming the function and the sample: it raised (sys.exit too), returned
something other than one number per sample, or a number that is not finite in float32 (the dtype rewards are
used in). The critic job itself stays up and answers the next request.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np

from aligner.rewards.function import RewardFunctionError
from aligner.rewards.pool import RewardPool

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
    """The function of `spec` (`path.py[:name]`) in a pool of worker processes, plus the tokenizer that turns token
    rows back into text. `workers=0`: no pool (the ranks other than 0, which never call it)."""

    def __init__(self, spec: str, tokenizer_path: str, workers: int, timeout_s: float, samples_per_call: int = 1):
        self.spec = spec
        self.decode = load_tokenizer_decode(tokenizer_path)
        self.pool = RewardPool(spec, workers, timeout_s, samples_per_call, keys="reward_fn_") if workers else None

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
        if self.pool is None:
            raise RuntimeError("this rank holds no reward-function workers (they run on rank 0)")
        prompts, responses = self.texts(tokens_BT, lengths_B, prompt_lengths_B)
        return self.pool.score(prompts, responses, labels)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
