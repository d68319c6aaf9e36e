"""Export an aligner checkpoint (a converted directory, or a step directory a job saved) to a Hugging Face
directory loadable with `AutoModelForCausalLM` (policies) or `AutoModelForSequenceClassification` (reward models,
critics).

    python scripts/convert_nemo_to_hf.py --input CKPT_DIR --output HF_DIR [--model-config DIR_OR_YAML]

The model config is `model.yaml` in --input, or --model-config (a model.yaml, or the converted directory the job
started from, whose hf_config.json then makes config.json exact). Runs as one process, whatever TP/PP layout saved
the checkpoint. See docs/CONVERSION.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.checkpoint.convert import USER_ERRORS, convert_dist_to_hf  # noqa: E402
from aligner.parallel import shutdown  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="aligner checkpoint directory (holding model/ or metadata.json)")
    p.add_argument("--output", required=True, help="HF directory to create (written atomically)")
    p.add_argument("--model-config", default=None, help="model.yaml, or a directory holding one (default: --input)")
    p.add_argument(
        "--model-type",
        choices=("policy", "reward"),
        default=None,
        help="check the head (default: read off the checkpoint)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="dtype of the HF weights (default: the model's params_dtype)",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer to ship (default: model.yaml's tokenizer)")
    p.add_argument("--max-shard-size", default="5GB", help="size cap per safetensors file, e.g. 5GB, 500MB")
    p.add_argument(
        "--drop-score-bias",
        action="store_true",
        help="export a scalar head whose bias is not 0 (HF's score layer has no bias)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = convert_dist_to_hf(
            args.input,
            args.output,
            model_config=args.model_config,
            model_type=args.model_type,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            tokenizer=args.tokenizer,
            drop_score_bias=args.drop_score_bias,
            overwrite=args.overwrite,
        )
    except USER_ERRORS as exc:
        print(f"convert_nemo_to_hf: error: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main())
