"""Generate one response per prompt with a checkpoint's policy (a converted HF model or an actor checkpoint).

    python scripts/generate.py --checkpoint DIR --prompts IN.jsonl --output OUT.jsonl --max-new-tokens N [--greedy]
    torchrun --nproc-per-node N scripts/generate.py ... --tp T --pp P   (or srun / mpiexec -n N: N/(T*P) data-parallel)

IN: JSONL, Parquet or a saved HF dataset directory; each row a `prompt` string or a `messages` chat (docs/DATA.md).
OUT: one JSON line per input line, in order: {"prompt", "response", "response_token_ids"} (written atomically).
Greedy decoding in float32 equals HF `generate(do_sample=False)`. A bad option or prompt file, or a checkpoint whose
tensors disagree with its model.yaml (loading is strict): one line, exit 2.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config import ConfigError  # noqa: E402
from aligner.data.rows import DataError  # noqa: E402
from aligner.generation.offline import OfflineOptions  # noqa: E402


def parse_args(argv) -> OfflineOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="converted model or <exp>/checkpoints/step_N (has model.yaml)")
    p.add_argument("--prompts", required=True, help="prompt file: .jsonl, .parquet or a saved HF dataset directory")
    p.add_argument("--output", required=True, help="JSONL file to write (replaced atomically)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="most tokens generated per response")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (else sampling)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i (default 0)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per engine call (default 32)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--tokenizer", default=None, help="default: <checkpoint>/tokenizer, else model.yaml's")
    p.add_argument("--prompt-key", default="prompt", help="row field of a plain prompt (default prompt)")
    p.add_argument("--messages-key", default="messages", help="row field of a chat (default messages)")
    p.add_argument(
        "--long-prompts",
        choices=("error", "truncate_left"),
        default="error",
        help="a prompt longer than the model's positions minus --max-new-tokens: refuse it, or keep its end",
    )
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto", help="engine dtype")
    a = p.parse_args(argv)
    return OfflineOptions(
        a.checkpoint, a.prompts, a.output, a.max_new_tokens, a.greedy, a.temperature, a.top_p, a.top_k, a.seed,
        a.batch_size, a.tp, a.pp, a.tokenizer, a.prompt_key, a.messages_key, a.long_prompts, a.dtype,
    )  # fmt: skip


def main(argv) -> int:
    opts = parse_args(argv)
    from aligner.utils.logs import setup_logging

    setup_logging()
    from aligner.parallel import discover, initialize, is_logging_rank, shutdown

    try:
        opts.validate(discover().world_size)
    except ConfigError as exc:
        print(f"generate: {exc}", file=sys.stderr)
        return 2
    from aligner.checkpoint.dist_ckpt import CheckpointError
    from aligner.generation.offline import generate_file

    initialize(opts.tp, opts.pp, seed=opts.seed)
    code = 1  # an exception below: its traceback, then exit 1
    try:
        n = generate_file(opts)
        if is_logging_rank():
            print(f"wrote {os.path.abspath(opts.output)} ({n} responses)", flush=True)
        code = 0
    except (ConfigError, DataError, CheckpointError) as exc:  # every rank reads the same files: all stop alike
        print(f"generate: {exc}", file=sys.stderr)
        code = 2
    finally:
        shutdown(exit_code_if_stuck=code)
    return code


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main(sys.argv[1:]))
