"""Write the CPU demos' assets into conf/demo/: a character-level tokenizer (made with the `tokenizers` library,
nothing downloaded), the PPO demo's train/validation prompts, the GRPO demo's sums (`a plus 1:`, label a + 1, for
a = 0..8; validated greedily on the same prompts), SFT rows (prompt + response: echo the words) and preference rows
(chosen responses are rich in "a", rejected ones hold none: the property the demo reward model learns, and the one the
PPO demo's reward function scores). Deterministic; the outputs are committed.

    python scripts/make_demo_assets.py [--out conf/demo]
"""

import argparse
import json
import os
import random
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list(string.ascii_lowercase) + list(string.digits) + list(" .,:?!-'")
WORDS = ["cat", "dog", "sun", "tree", "bird", "fish", "moon", "star", "rain", "rock", "leaf", "wind"]


def build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)  # already in the vocabulary: marks them special (skipped when decoding)
    # A prompt starts with <bos>, added by the tokenizer itself as Llama's does: the jobs add no special tokens.
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return tok


def prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        out.append({"prompt": f"say a: {words}:", "label": "a"})
    return out


def sft_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        out.append({"prompt": f"say a: {words}:", "response": f" {words}."})
    return out


def preference_rows(n: int, seed: int) -> list[dict]:
    """Chosen and rejected responses of equal length; about half of chosen's letters are "a", rejected has none."""
    rng = random.Random(seed)
    others = [c for c in string.ascii_lowercase if c != "a"]
    out = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 3)))
        length = rng.randint(4, 12)
        chosen = "".join("a" if rng.random() < 0.5 else rng.choice(others) for _ in range(length))
        rejected = "".join(rng.choice(others) for _ in range(length))
        out.append({"prompt": f"say a: {words}:", "chosen": f" {chosen}", "rejected": f" {rejected}"})
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def plus_one() -> list[dict]:
    return [{"prompt": f"{a} plus 1:", "label": str(a + 1)} for a in range(9)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "conf", "demo"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build_tokenizer().save(os.path.join(args.out, "tokenizer.json"))
    files = [
        ("prompts_train.jsonl", prompts(256, 0)),
        ("prompts_val.jsonl", prompts(16, 1)),
        ("plus_one.jsonl", plus_one()),
        ("sft_train.jsonl", sft_rows(384, 2)),
        ("sft_val.jsonl", sft_rows(48, 3)),
        ("preference_train.jsonl", preference_rows(384, 4)),
        ("preference_val.jsonl", preference_rows(48, 5)),
    ]
    for name, rows in files:
        write_jsonl(os.path.join(args.out, name), rows)
    vocab = len(SPECIALS) + len(CHARS)
    print(f"wrote {args.out}/tokenizer.json (vocab {vocab}), {', '.join(name for name, _ in files)}")


if __name__ == "__main__":
    main()
