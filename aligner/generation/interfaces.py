"""What the PPO loop sees of a generation engine: three methods, one optional capability, two dataclasses.

Contract (who calls what, in which order):
- An engine is built once (`aligner.generation.build_engine`) from the policy's config with maximum batch size,
  prompt length and response length; every buffer it needs (weights, KV cache, CUDA graphs) is sized then.
- `generate(prompt_tokens_BT, prompt_lengths_B, sampling)` samples one response per prompt. Prompts are
  right-padded: row b holds its prompt in `[:prompt_lengths_B[b]]`, anything after is ignored. Every rank of a
  tensor-parallel group calls it with the same prompts and sampling parameters (it is one SPMD program) and gets
  the same tokens back.
- `refit(policy)` copies the policy's current weights (this rank's TP shard, training layout) into the engine in
  place: no rebuild, no reallocation, so captured CUDA graphs stay valid. Call it after every optimizer step that
  should be visible to the next rollout; generation between steps uses the weights of the last refit.
- `close()` frees what the engine holds (CUDA graphs, KV cache, weights copy); the engine is unusable after it. The
  job calls it once, before its process groups are destroyed: CUDA graphs that captured the TP all-reduces keep
  NCCL's communicator teardown waiting forever (aligner.parallel.launch).
- `ReleasableMemory` (optional, its own Protocol): `release_memory()` frees the KV cache so training can use the
  memory; `acquire_memory()` takes it back before the next `generate`. Check with `isinstance(e, ReleasableMemory)`.

Log-probs: `GenerationOutput.logprobs_BR` holds log_softmax(logits / temperature) over the real (unpadded)
vocabulary at each sampled token: the distribution training recomputes with the same temperature. Top-k, top-p and
`min_new_tokens` restrict which tokens may be *drawn*; they do not renormalise the returned log-probs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """How to draw each response token. Defaults: plain sampling at temperature 1, stop at `eos_token_id`.

    - greedy: argmax (temperature then only scales the returned log-probs).
    - temperature > 0 divides the logits; top_k (0 = off) and top_p (1.0 = off) restrict the candidates (top-p keeps
      the smallest set of most likely tokens whose probability reaches top_p, after temperature and top-k).
    - eos_token_id (one id or several) and stop_token_ids end a sample; the ending token is part of the response and
      counts in its length. ignore_eos: neither ends a sample (benchmarks force the full length).
    - min_new_tokens: ending tokens cannot be drawn while fewer than this many tokens were generated.
    - max_new_tokens: None = the engine's max_response_length; more is an error.
    - seeds: one per sample, or `seed` as a base (sample b gets seed + b); with neither, a base seed is drawn from
      torch's global generator (then shared by the TP group). The draws of a sample depend only on its seed, its
      prompt and the weights, never on the rest of the batch.
    - pad_token_id fills response slots after a sample ended.
    """

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0
    max_new_tokens: int | None = None
    eos_token_id: int | Sequence[int] | None = None
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    seeds: Sequence[int] | None = None
    pad_token_id: int = 0

    def end_token_ids(self) -> list[int]:
        """EOS and stop tokens (empty with ignore_eos)."""
        if self.ignore_eos:
            return []
        eos = self.eos_token_id
        ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return sorted(set(ids) | set(self.stop_token_ids))

    def validate(self, batch_size: int, vocab_size: int, max_response_length: int) -> None:
        """Raise ValueError naming the bad field and the fix."""
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"sampling.temperature={self.temperature}: must be > 0 (use greedy=True for argmax)")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p={self.top_p}: must be in (0, 1] (1.0 disables top-p)")
        if self.max_new_tokens is not None and not 1 <= self.max_new_tokens <= max_response_length:
            raise ValueError(
                f"sampling.max_new_tokens={self.max_new_tokens}: must be in [1, {max_response_length}] "
                "(the engine's max_response_length; rebuild the engine for longer responses)"
            )
        if self.min_new_tokens < 0:
            raise ValueError(f"sampling.min_new_tokens={self.min_new_tokens}: must be >= 0")
        for tok in self.end_token_ids() + [self.pad_token_id]:
            if not 0 <= tok < vocab_size:
                raise ValueError(
                    f"sampling: token id {tok} (EOS, stop or pad) is outside the vocabulary [0, {vocab_size})"
                )
        if self.seeds is not None and len(self.seeds) != batch_size:
            raise ValueError(
                f"sampling.seeds has {len(self.seeds)} entries for a batch of {batch_size}: give one per "
                "sample, or a base `seed`"
            )


@dataclass
class GenerationOutput:
    """One response per prompt, right-padded to R = the longest response of this call (<= max_new_tokens).

    response_tokens_BR int64 (pad_token_id after the end), response_lengths_B int64 (ending token included),
    logprobs_BR float32 (0 after the end), ended_B bool (True: ended by EOS or a stop token; False: cut at
    max_new_tokens). All on the engine's device.
    """

    response_tokens_BR: torch.Tensor
    response_lengths_B: torch.Tensor
    logprobs_BR: torch.Tensor
    ended_B: torch.Tensor


@runtime_checkable
class GenerationEngine(Protocol):
    def generate(
        self, prompt_tokens_BT: torch.Tensor, prompt_lengths_B: torch.Tensor, sampling: SamplingParams
    ) -> GenerationOutput: ...

    def refit(self, policy: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ReleasableMemory(Protocol):
    def release_memory(self) -> None: ...

    def acquire_memory(self) -> None: ...
