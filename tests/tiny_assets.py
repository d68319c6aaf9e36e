"""Tokenizers and prompt files for the data, generation and walk-through tests, built in the test (nothing
downloaded): a whitespace word-level vocabulary `<pad> <s> </s> <|user|> <|assistant|> <|system|> w6 w7 ...` whose
post-processor prepends `<s>` (as Llama's does) or adds nothing (as GPT-2's and Qwen2's), with an optional chat
template that writes `<s>` itself (as Llama 3's does).
"""

from __future__ import annotations

import json

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
PAD, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(n_tokens: int = 90, bos: bool = True, chat: bool = True):
    """An HF fast tokenizer of `n_tokens` ids (save it with `.save_pretrained(dir)`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), n_tokens)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
    )
    if chat:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)
