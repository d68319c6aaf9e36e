"""One tokenizer type for the jobs: `load_tokenizer(path)` from a tokenizer.json (HF `tokenizers`) or an HF tokenizer
directory (transformers' AutoTokenizer, local files only). Nothing is downloaded.

`Tokenizer.encode(text)` adds no special tokens (pieces of text inside a sequence). `Tokenizer.encode_prompt(text)`
tokenises a whole prompt exactly as the HF tokenizer does by default (`tokenizer(text)["input_ids"]`): its
post-processor decides which special tokens to add (e.g. Llama's BOS; GPT-2's and Qwen2's add none), nothing else
is added. `Tokenizer.apply_chat_template(messages, add_generation_prompt)` renders a chat (a list of
{"role", "content"} dicts) with the tokenizer's own template and returns its token ids, as `transformers` does (the
template writes any BOS itself, so the text is encoded without special tokens); a tokenizer without a template raises
ValueError.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


@dataclass
class Tokenizer:
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    vocab_size: int
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: int
    stop_ids: tuple[int, ...] = ()  # more ids that end a response: generation_config.json's eos_token_id
    render_chat: Optional[Callable[[list, bool], str]] = None  # (messages, add_generation_prompt) -> text
    encode_with_specials: Optional[Callable[[str], list[int]]] = None  # None: the tokenizer adds no special tokens

    def encode_prompt(self, text: str) -> list[int]:
        """`text` as a whole prompt: the tokenizer's post-processor adds its special tokens (BOS or none)."""
        return (self.encode_with_specials or self.encode)(text)

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True) -> list[int]:
        if self.render_chat is None:
            raise ValueError(
                "this tokenizer has no chat template: use plain `prompt` rows, or an HF tokenizer directory whose "
                "tokenizer_config.json (or chat_template.jinja) holds one"
            )
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _find(vocab: dict, names) -> Optional[int]:
    for name in names:
        if name in vocab:
            return vocab[name]
    return None


def generation_stop_ids(directory: str) -> tuple[int, ...]:
    """The ids `generation_config.json` in `directory` (beside the tokenizer files; conversion puts a copy there)
    ends generation with: its `eos_token_id`, one id or a list (Llama 3 instruct: <|end_of_text|> and <|eot_id|>)."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return tuple(int(i) for i in ([] if eos is None else [eos] if isinstance(eos, int) else eos))


def load_tokenizer(path: str) -> Tokenizer:
    if not path or not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer {path!r} not found: give a tokenizer.json or an HF tokenizer directory")
    if os.path.isfile(path):
        from tokenizers import Tokenizer as RawTokenizer

        raw = RawTokenizer.from_file(path)
        vocab = raw.get_vocab()
        bos = _find(vocab, ("<bos>", "<s>", "<|begin_of_text|>", "[BOS]"))
        eos = _find(vocab, ("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "[EOS]"))
        pad = _find(vocab, ("<pad>", "[PAD]"))
        return Tokenizer(
            encode=lambda text: raw.encode(text, add_special_tokens=False).ids,
            encode_with_specials=lambda text: raw.encode(text, add_special_tokens=True).ids,
            decode=lambda ids: raw.decode(list(ids), skip_special_tokens=True),
            vocab_size=raw.get_vocab_size(),
            bos_id=bos,
            eos_id=eos,
            pad_id=pad if pad is not None else (eos or 0),
            stop_ids=generation_stop_ids(os.path.dirname(os.path.abspath(path))),
        )
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
    return Tokenizer(
        encode=lambda text: hf.encode(text, add_special_tokens=False),
        encode_with_specials=lambda text: hf.encode(text, add_special_tokens=True),
        decode=lambda ids: hf.decode(list(ids), skip_special_tokens=True),
        vocab_size=len(hf),
        bos_id=hf.bos_token_id,
        eos_id=hf.eos_token_id,
        pad_id=pad,
        stop_ids=generation_stop_ids(path),
        render_chat=(
            (lambda messages, gen: hf.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False))
            if getattr(hf, "chat_template", None)
            else None
        ),
    )
