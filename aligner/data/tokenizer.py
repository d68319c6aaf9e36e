"""One tokenizer type for the jobs: `load_tokenizer(path)` from a tokenizer.json (HF `tokenizers`) or an HF tokenizer
directory (transformers' AutoTokenizer, local files only). Nothing is downloaded."""

from __future__ import annotations

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


def _find(vocab: dict, names) -> Optional[int]:
    for name in names:
        if name in vocab:
            return vocab[name]
    return None


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
            decode=lambda ids: raw.decode(list(ids), skip_special_tokens=True),
            vocab_size=raw.get_vocab_size(),
            bos_id=bos,
            eos_id=eos,
            pad_id=pad if pad is not None else (eos or 0),
        )
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
    return Tokenizer(
        encode=lambda text: hf.encode(text, add_special_tokens=False),
        decode=lambda ids: hf.decode(list(ids), skip_special_tokens=True),
        vocab_size=len(hf),
        bos_id=hf.bos_token_id,
        eos_id=hf.eos_token_id,
        pad_id=pad,
    )
