"""Tokenizers and prompt files for the data, generation and walk-through tests, built in the test (nothing
downloaded). Both kinds start with the specials `<pad> <s> </s> <|user|> <|assistant|> <|system|>`, may prepend `<s>`
in their post-processor (as Llama's does) or add nothing (as GPT-2's), and may carry a chat template that writes `<s>`
itself (as Llama 3's does):
- `word_tokenizer`: whitespace words `w6 w7 ...` (one id per word);
- `bpe_tokenizer`: a byte-level BPE trained here on text of such words (the kind GPT-2, Llama 3 and Qwen2 ship), which
  transformers' AutoTokenizer loads faithfully whatever class it picks for a model directory (for Qwen2 it forces
  Qwen2Tokenizer, which rebuilds the tokenizer from tokenizer.json's BPE vocabulary and merges).
"""

from __future__ import annotations

import json

import torch

SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]
PAD, BOS, EOS = 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word_tokenizer(n_tokens: int = 90, bos: bool = True, chat: bool = True):
    """An HF fast tokenizer of `n_tokens` ids (save it with `.save_pretrained(dir)`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), n_tokens)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return _wrap(tok, chat)


def _wrap(tok, chat: bool):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=SPECIALS[3:],
    )
    if chat:
        hf.chat_template = CHAT_TEMPLATE
    return hf


def bpe_tokenizer(n_tokens: int = 90, bos: bool = True, chat: bool = True):
    """A byte-level BPE HF fast tokenizer of `n_tokens` ids, trained on lines of words w0 .. w99 (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(f"w{i}" for i in range(j, 100, 7)) for j in range(7)]
    trainer = trainers.BpeTrainer(
        vocab_size=n_tokens, special_tokens=SPECIALS, initial_alphabet=[], show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return _wrap(tok, chat)


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


# -- generation sources: a tiny random HF model, its prompts and HF's greedy answers ---------------------------------
MAX_NEW = 10
CHAT = [{"role": "system", "content": "w20 w21"}, {"role": "user", "content": "w7 w30"}]
ROWS = [
    {"prompt": "w7 w8 w9"},
    {"prompt": "w40"},
    {"messages": CHAT},
    {"prompt": "w11 w12 w13 w14 w15 w16"},
]


def prompt_ids(hf_tok, row) -> list[int]:
    if "messages" in row:
        return hf_tok.apply_chat_template(row["messages"], add_generation_prompt=True)["input_ids"]
    return hf_tok(row["prompt"])["input_ids"]


@torch.no_grad()
def hf_greedy(model, ids, max_new=MAX_NEW) -> list[int]:
    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new, pad_token_id=PAD)
    return out[0, len(ids) :].tolist()


def make_source(kind: str, directory) -> tuple:
    """A tiny random HF `kind` model saved with a byte-level BPE tokenizer that adds BOS and has a chat template, and
    that tokenizer as transformers loads it for this model (AutoTokenizer: the reference). Its generation_config stops
    at </s> and at the token greedy decoding emits third for the first prompt, so that response ends with a stop."""
    from convert_models import N_TOKENS, make_hf
    from transformers import AutoTokenizer

    model = make_hf(kind)
    model.config.bos_token_id, model.config.eos_token_id = BOS, EOS
    model.generation_config.bos_token_id, model.generation_config.pad_token_id = BOS, PAD
    model.generation_config.eos_token_id = [EOS]
    model.save_pretrained(directory)
    bpe_tokenizer(N_TOKENS).save_pretrained(directory)
    hf_tok = AutoTokenizer.from_pretrained(directory)
    stop = hf_greedy(model, prompt_ids(hf_tok, ROWS[0]), 3)[-1]
    model.generation_config.eos_token_id = sorted({EOS, stop})
    model.generation_config.save_pretrained(directory)
    return model, hf_tok, stop
