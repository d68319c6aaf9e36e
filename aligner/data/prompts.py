"""Prompt datasets: rows (aligner.data.rows) with a prompt field (and an optional label for reward functions).

`PromptDataset` tokenises every line once at start-up; prompts longer than the budget are reported (count and the
first line numbers) and skipped, never truncated. `PromptSampler` walks a seeded permutation per epoch; its state
is the number of samples consumed, so a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from aligner.data.rows import DataError, read_rows
from aligner.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class Prompt:
    text: str
    ids: list[int]
    label: Optional[str]


class PromptDataset:
    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer,
        max_length: int,
        prompt_key: str = "prompt",
        label_key: str = "label",
        add_bos: bool = True,
    ):
        self.path = path
        self.items: list[Prompt] = []
        too_long, rows = [], 0
        for row in read_rows(path):
            rows += 1
            text = row.data.get(prompt_key)
            if not isinstance(text, str):
                raise DataError(row.where, f"needs a string field {prompt_key!r} (data.prompt_key)")
            ids = tokenizer.encode(text)
            if add_bos and tokenizer.bos_id is not None:
                ids = [tokenizer.bos_id] + ids
            if not ids:
                raise DataError(row.where, "the prompt tokenises to nothing")
            if len(ids) > max_length:
                too_long.append(row.where)
                continue
            label = row.data.get(label_key)
            self.items.append(Prompt(text, ids, None if label is None else str(label)))
        if too_long:
            log.warning(
                "%s: skipped %d of %d prompts longer than %d tokens (generation.max_prompt_length); first: %s",
                path,
                len(too_long),
                rows,
                max_length,
                too_long[:10],
            )
        self.skipped = len(too_long)
        if not self.items:
            raise DataError(
                path,
                f"no usable prompts ({rows} rows, {len(too_long)} longer than {max_length} tokens): raise "
                "generation.max_prompt_length or check the file",
            )

    def __len__(self):
        return len(self.items)


class PromptSampler:
    """Deterministic batches of dataset indices: epoch e uses permutation seed + e."""

    def __init__(self, size: int, seed: int, shuffle: bool = True, consumed: int = 0):
        self.size, self.seed, self.shuffle, self.consumed = size, seed, shuffle, consumed
        self._perm_epoch, self._perm = None, None

    def _order(self, epoch: int) -> list[int]:
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.size, generator=g).tolist()
            else:
                self._perm = list(range(self.size))
            self._perm_epoch = epoch
        return self._perm

    def next_batch(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.consumed, self.size)
            out.append(self._order(epoch)[pos])
            self.consumed += 1
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def pad_prompts(prompts: list[Prompt], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded prompt ids [B, Tp] and lengths [B]."""
    lengths = torch.tensor([len(p.ids) for p in prompts], dtype=torch.long)
    tokens = torch.full((len(prompts), int(lengths.max())), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        tokens[i, : len(p.ids)] = torch.tensor(p.ids)
    return tokens, lengths
