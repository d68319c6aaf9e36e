"""The supervised trainers' datasets: SFT samples and preference pairs, tokenised once at start-up.

Rows come from `aligner.data.rows.read_rows` (so every file format it reads works here); chats are rendered only
through `Tokenizer.apply_chat_template`.

SFT rows (`SFTDataset`)
- plain: `prompt` + `response` strings -> [BOS] + prompt + response + [EOS]; targets: the response and EOS.
- chat: `messages`, a list of {"role", "content"} -> the tokenizer's chat template; targets: every assistant turn
  (its content and the template's end-of-turn tokens). A turn's tokens are found by rendering the conversation up
  to it (with the generation prompt) and up to its end: both renders must be prefixes of the whole conversation's,
  as they are for templates that mark turns with special tokens.
Preference rows (`PreferenceDataset`): `prompt` (or `messages`), `chosen`, `rejected`; for a chat the responses
are strings (one assistant turn), an assistant message, or a list of messages. Both sequences of a pair start with
the same prompt tokens; targets (DPO's log-probs) are the tokens after them. The reward model reads the last token.

Bad rows (a missing or non-string field, a malformed chat, an empty response, more than `data.max_length` tokens):
with `data.bad_rows=error` the first raises `DataError(row.where, why)`; with `skip` each is dropped and all are
reported in one warning (count and the first places, `file:line`). A file left with no usable row is a DataError.
Problems of the file itself (missing, not JSON) are `read_rows`' DataErrors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from aligner.data.rows import DataError, read_rows
from aligner.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class BadRow(Exception):
    """A row that cannot become an example; the message says why (the caller adds the place)."""


@dataclass
class Sample:
    """One SFT sequence: token ids [T] and `targets` [T] (True where the token is trained on, i.e. a response token;
    position 0 is never a target, since nothing precedes it)."""

    ids: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class Pair:
    """One preference pair: full sequences (prompt + response) and the shared prompt length."""

    chosen: np.ndarray
    rejected: np.ndarray
    prompt_length: int

    def __len__(self) -> int:
        return max(len(self.chosen), len(self.rejected))


class _Problems:
    def __init__(self, path: str, policy: str):
        self.path, self.policy, self.places = path, policy, []

    def bad(self, where: str, why: str) -> None:
        if self.policy == "error":
            raise DataError(where, f"{why} (data.bad_rows=skip skips such rows)")
        self.places.append(f"{where} ({why})")

    def finish(self, kept: int, rows: int) -> None:
        if self.places:
            log.warning(
                "%s: skipped %d of %d rows (data.bad_rows=skip); first: %s",
                self.path,
                len(self.places),
                rows,
                "; ".join(self.places[:10]),
            )
        if kept == 0:
            first = f"; first problem: {self.places[0]}" if self.places else ""
            raise DataError(self.path, f"no usable rows ({rows} rows, {len(self.places)} skipped){first}")


def _string(data: dict, key: str, what: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        found = "missing" if value is None else f"a {type(value).__name__}"
        raise BadRow(f"needs a string field {key!r} ({what}), found {found}")
    return value


def _messages(value, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise BadRow(f"{key!r} must be a non-empty list of {{'role', 'content'}} messages")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRow(f"every message in {key!r} needs string 'role' and 'content' fields, found {m!r:.80}")
    return value


class Renderer:
    """Rows -> token ids, with the config's keys and BOS/EOS rules (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, cfg):
        self.tok, self.cfg = tokenizer, cfg

    # -- pieces --------------------------------------------------------------------------------------------
    def chat(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        try:
            return list(self.tok.apply_chat_template(messages, add_generation_prompt))
        except ValueError as exc:  # no template at all: every chat row would fail, so this is not a row problem
            raise DataError(self.cfg.messages_key, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - the template's own complaint (jinja raises its own types)
            raise BadRow(f"the chat template rejects this conversation: {exc}") from None

    def plain_prompt(self, text: str) -> list[int]:
        bos = [self.tok.bos_id] if self.cfg.add_bos and self.tok.bos_id is not None else []
        return bos + self.tok.encode(text)

    def plain_response(self, text: str, key: str) -> list[int]:
        ids = self.tok.encode(text) if text.strip() else []
        if not ids:
            raise BadRow(f"empty {key!r}")
        eos = [self.tok.eos_id] if self.cfg.add_eos and self.tok.eos_id is not None else []
        return ids + eos

    def _check_length(self, n: int) -> None:
        if n > self.cfg.max_length:
            raise BadRow(f"{n} tokens, more than data.max_length={self.cfg.max_length}")

    def _prefix(self, whole: list[int], part: list[int]) -> None:
        if whole[: len(part)] != part:
            raise BadRow(
                "the chat template does not render this conversation's beginning as a prefix of the whole, so "
                "the response tokens cannot be located"
            )

    # -- SFT -----------------------------------------------------------------------------------------------
    def sample(self, data: dict) -> Sample:
        c = self.cfg
        if c.messages_key in data:
            messages = _messages(data[c.messages_key], c.messages_key)
            ids = self.chat(messages, add_generation_prompt=False)
            targets = np.zeros(len(ids), dtype=bool)
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                if i == 0:
                    raise BadRow("the conversation starts with an assistant message: there is no prompt for it")
                start = self.chat(messages[:i], add_generation_prompt=True)
                end = self.chat(messages[: i + 1], add_generation_prompt=False)
                self._prefix(end, start)
                self._prefix(ids, end)
                targets[len(start) : len(end)] = True
            if not targets.any():
                raise BadRow(f"no assistant message with content in {c.messages_key!r}: nothing to train on")
        else:
            prompt = self.plain_prompt(_string(data, c.prompt_key, "data.prompt_key"))
            response = self.plain_response(_string(data, c.response_key, "data.response_key"), c.response_key)
            ids = prompt + response
            targets = np.zeros(len(ids), dtype=bool)
            targets[len(prompt) :] = True
        self._check_length(len(ids))
        targets[0] = False
        return Sample(np.asarray(ids, dtype=np.int64), targets)

    # -- preferences ---------------------------------------------------------------------------------------
    def _chat_reply(self, messages: list[dict], prompt: list[int], value, key: str) -> list[int]:
        if isinstance(value, str):
            if not value.strip():
                raise BadRow(f"empty {key!r}")
            reply = [{"role": "assistant", "content": value}]
        elif isinstance(value, dict):
            reply = _messages([value], key)
        else:
            reply = _messages(value, key)
        ids = self.chat(messages + reply, add_generation_prompt=False)
        self._prefix(ids, prompt)
        if len(ids) == len(prompt):
            raise BadRow(f"empty {key!r}")
        return ids

    def pair(self, data: dict) -> Pair:
        c = self.cfg
        if c.messages_key in data:
            messages = _messages(data[c.messages_key], c.messages_key)
            prompt = self.chat(messages, add_generation_prompt=True)
            chosen = self._chat_reply(messages, prompt, data.get(c.chosen_key), c.chosen_key)
            rejected = self._chat_reply(messages, prompt, data.get(c.rejected_key), c.rejected_key)
        else:
            prompt = self.plain_prompt(_string(data, c.prompt_key, "data.prompt_key"))
            chosen = prompt + self.plain_response(_string(data, c.chosen_key, "data.chosen_key"), c.chosen_key)
            rejected = prompt + self.plain_response(_string(data, c.rejected_key, "data.rejected_key"), c.rejected_key)
        self._check_length(max(len(chosen), len(rejected)))
        return Pair(np.asarray(chosen, dtype=np.int64), np.asarray(rejected, dtype=np.int64), len(prompt))


def _load(path: str, tokenizer: Tokenizer, cfg, make) -> list:
    renderer, problems = Renderer(tokenizer, cfg), _Problems(path, cfg.bad_rows)
    items, rows = [], 0
    for row in read_rows(path):
        rows += 1
        try:
            items.append(make(renderer, row.data))
        except BadRow as exc:
            problems.bad(row.where, str(exc))
    problems.finish(len(items), rows)
    return items


class SFTDataset:
    def __init__(self, path: str, tokenizer: Tokenizer, cfg):
        self.path = path
        self.samples: list[Sample] = _load(path, tokenizer, cfg, Renderer.sample)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


class PreferenceDataset:
    def __init__(self, path: str, tokenizer: Tokenizer, cfg):
        self.path = path
        self.pairs: list[Pair] = _load(path, tokenizer, cfg, Renderer.pair)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> Pair:
        return self.pairs[i]
