"""Prompt datasets: rows (aligner.data.rows: JSONL, Parquet, a saved HF dataset) holding a prompt, and an optional
label for reward functions. The formats, with examples: docs/DATA.md.

Each row holds exactly one of
- a plain prompt: a string under `prompt_key` (default "prompt"), tokenised as the HF tokenizer does by default
  (`Tokenizer.encode_prompt`: its post-processor decides BOS; nothing is added here), or
- a chat: a list of {"role": str, "content": ...} messages under `messages_key` (default "messages"), rendered with
  the tokenizer's chat template with `add_generation_prompt=True` (`Tokenizer.apply_chat_template`), so the model
  answers as the assistant.
`label_key` (default "label"): an optional value passed to the reward function (a string; other JSON values as their
JSON text).

`render_prompt(row, tokenizer, ...)` does this for one row; `PromptDataset` tokenises every row once at start-up.
Prompts longer than `max_length` tokens follow `long_prompts`: "skip" (counted, and the first places logged),
"truncate_left" (keep the last `max_length` tokens: the end of the prompt, where a chat's generation prompt is), or
"error" (a DataError naming the row). A bad row is a DataError naming its file and line.
`PromptSampler` walks a seeded permutation per epoch; its state is the number of samples consumed, so a resumed run
continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Optional

import torch

from aligner.data.rows import DataError, Row, read_rows
from aligner.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LONG_PROMPTS = ("skip", "truncate_left", "error")


@dataclass
class Prompt:
    text: str  # the prompt as given, or the chat as the template rendered it
    ids: list[int]
    label: Optional[str]
    where: str = ""  # file and line (or row) it came from


def _check_messages(messages, where: str, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(where, f"{key!r} must be a non-empty list of {{'role': ..., 'content': ...}} messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise DataError(
                where, f"{key}[{i}] must be an object with a string 'role' and a 'content', got {json.dumps(m)[:80]}"
            )


def render_prompt(
    row: Row, tokenizer: Tokenizer, prompt_key: str = "prompt", messages_key: str = "messages"
) -> tuple[str, list[int]]:
    """(text, token ids) of one row's prompt: a plain prompt or a chat (module docstring); DataError otherwise."""
    text, messages = row.data.get(prompt_key), row.data.get(messages_key)
    if text is not None and messages is not None:
        raise DataError(
            row.where, f"has both {prompt_key!r} and {messages_key!r}: give one (data.prompt_key, data.messages_key)"
        )
    if messages is not None:
        _check_messages(messages, row.where, messages_key)
        if tokenizer.render_chat is None:
            raise DataError(
                row.where,
                f"a chat row ({messages_key!r}) but the tokenizer has no chat template: use an HF tokenizer directory "
                "whose tokenizer_config.json (or chat_template.jinja) holds one, or plain prompt rows",
            )
        try:
            text = tokenizer.render_chat(messages, True)
        except Exception as exc:  # noqa: BLE001 - jinja templates raise their own messages (e.g. role order)
            raise DataError(row.where, f"the chat template refused these messages: {exc}") from None
        ids = tokenizer.encode(text)
    elif isinstance(text, str):
        ids = tokenizer.encode_prompt(text)
    else:
        found = "missing" if text is None else f"of type {type(text).__name__}"
        raise DataError(
            row.where,
            f"needs a string {prompt_key!r} (data.prompt_key) or a list {messages_key!r} (data.messages_key); "
            f"{prompt_key!r} is {found}",
        )
    if not ids:
        raise DataError(row.where, "the prompt tokenises to nothing")
    return text, ids


def _label(value) -> Optional[str]:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)


class PromptDataset:
    def __init__(
        self,
        path: str,
        tokenizer: Tokenizer,
        max_length: int,
        prompt_key: str = "prompt",
        label_key: str = "label",
        messages_key: str = "messages",
        long_prompts: str = "skip",
    ):
        if long_prompts not in LONG_PROMPTS:
            raise ValueError(f"long_prompts={long_prompts!r}: use one of {', '.join(LONG_PROMPTS)}")
        self.path = path
        self.items: list[Prompt] = []
        too_long, rows = [], 0
        for row in read_rows(path):
            rows += 1
            text, ids = render_prompt(row, tokenizer, prompt_key, messages_key)
            if len(ids) > max_length:
                too_long.append(row.where)
                if long_prompts == "error":
                    raise DataError(
                        row.where,
                        f"the prompt has {len(ids)} tokens, more than {max_length}: shorten it, or let long prompts "
                        "be skipped or truncated (data.long_prompts)",
                    )
                if long_prompts == "skip":
                    continue
                ids = ids[-max_length:]
            self.items.append(Prompt(text, ids, _label(row.data.get(label_key)), row.where))
        if too_long:
            log.warning(
                "%s: %s %d of %d prompts longer than %d tokens (generation.max_prompt_length, data.long_prompts=%s); "
                "first: %s",
                path,
                "skipped" if long_prompts == "skip" else "kept the last tokens of",
                len(too_long),
                rows,
                max_length,
                long_prompts,
                too_long[:10],
            )
        self.skipped = len(too_long) if long_prompts == "skip" else 0
        self.truncated = len(too_long) if long_prompts == "truncate_left" else 0
        if not self.items:
            raise DataError(
                path,
                f"no usable prompts ({rows} rows, {len(too_long)} longer than {max_length} tokens): raise "
                "generation.max_prompt_length, set data.long_prompts=truncate_left, or check the file",
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
