"""Write the CPU demos' assets into conf/demo/: a character-level tokenizer (made with the `tokenizers` library,
nothing downloaded), the PPO demo's train/validation prompts and the GRPO demo's sums (`a plus 1:`, label a + 1, for
a = 0..8; validated greedily on the same prompts). Deterministic; the outputs are committed.

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


def plus_one() -> list[dict]:
    return [{"prompt": f"{a} plus 1:", "label": str(a + 1)} for a in range(9)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "conf", "demo"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    build_tokenizer().save(os.path.join(args.out, "tokenizer.json"))
    for name, n, seed in (("prompts_train.jsonl", 256, 0), ("prompts_val.jsonl", 16, 1)):
        with open(os.path.join(args.out, name), "w") as f:
            for row in prompts(n, seed):
                f.write(json.dumps(row) + "\n")
    with open(os.path.join(args.out, "plus_one.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in plus_one())
    vocab = len(SPECIALS) + len(CHARS)
    print(f"wrote {args.out}/tokenizer.json (vocab {vocab}), prompts_train.jsonl, prompts_val.jsonl, plus_one.jsonl")


if __name__ == "__main__":
    main()
