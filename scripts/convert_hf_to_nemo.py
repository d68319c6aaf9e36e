"""Convert a Hugging Face checkpoint (Llama 2/3/3.1-3.3, Mistral, Qwen2/2.5, Qwen3 dense, GPT-2; causal LM or one-label
reward model) into aligner's format: a megatron-core dist checkpoint plus model.yaml, the tokenizer and the source
config.

    python scripts/convert_hf_to_nemo.py --input HF_DIR --output CKPT_DIR [--tp N --pp M] [--model-type policy|reward]
    torchrun --nproc-per-node N*M scripts/convert_hf_to_nemo.py --input HF_DIR --output CKPT_DIR --tp N --pp M

One process builds the model at TP=1/PP=1 (--tp/--pp are validated and recorded: dist checkpoints reshard on
load); exactly N*M ranks build the N x M layout, each rank holding only its slice. Point a job's `model.checkpoint`
at CKPT_DIR: the job takes the model's shape (model.yaml) and tokenizer from there. See docs/CONVERSION.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.checkpoint.convert import USER_ERRORS, convert_hf_to_dist  # noqa: E402
from aligner.parallel import discover, shutdown  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="HF checkpoint directory (config.json, weights, tokenizer)")
    p.add_argument("--output", required=True, help="directory to create (written atomically)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to validate (and build, on N*M ranks)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to validate (and build, on N*M ranks)")
    p.add_argument(
        "--model-type",
        choices=("policy", "reward"),
        default=None,
        help="default: from the architecture (*ForSequenceClassification = reward)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="params_dtype of the result (auto: as stored in the HF files)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, when not in --input")
    p.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="cap the sequence length (Llama family), e.g. to a sliding window",
    )
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = convert_hf_to_dist(
            args.input,
            args.output,
            model_type=args.model_type,
            tp=args.tp,
            pp=args.pp,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            max_position_embeddings=args.max_position_embeddings,
            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            overwrite=args.overwrite,
        )
    except USER_ERRORS as exc:
        print(f"convert_hf_to_nemo: error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if discover().rank == 0:
        print(f"wrote {out} (model.yaml, model/, tokenizer/, hf_config.json, conversion.json)")
    return 0


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main())
