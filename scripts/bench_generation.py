"""Benchmark the native generation engine against HF transformers `generate` (see benchmarks/generation.py).

GPU (the issue's setting): python scripts/bench_generation.py --out bench_generation.json
CPU smoke run:             python scripts/bench_generation.py --tiny --out /tmp/bench_tiny.json
Prompts of mixed lengths:  python scripts/bench_generation.py --skip-hf --ragged
GRPO-like groups:          python scripts/bench_generation.py --skip-hf --samples-per-prompt 8 --batch-sizes 512
An 8B-class model:         python scripts/bench_generation.py --skip-hf --preset 8b --decode-weights fp8 --kv-dtype fp8
Your model's shape:        python scripts/bench_generation.py --skip-hf --hf-config path/to/hf_model/config.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.generation import BenchArgs, format_generate_profile, format_table, model_from_hf_config, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None, help="default 64 256 (tiny: 2 4)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 16)")
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model: a CPU smoke run")
    parser.add_argument(
        "--preset",
        choices=("1b", "8b"),
        default=None,
        help="the model's shape (benchmarks/shapes.py, random weights): 1b (default; issue 17's goals), 8b",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        metavar="PATH",
        help="time your own model's shape: its Hugging Face config.json (or the directory holding it), random weights;"
        " with --skip-hf",
    )
    parser.add_argument("--skip-hf", action="store_true", help="native engine only")
    parser.add_argument("--hf-no-compile", action="store_true", help="HF static cache without torch.compile")
    parser.add_argument("--profile", action="store_true", help="also a top-kernels table of one call (torch profiler)")
    parser.add_argument("--profile-kernels", type=int, default=15, help="rows of that table (default 15)")
    parser.add_argument(
        "--decode-attention",
        default="auto",
        choices=["auto", "matmul", "sdpa", "flash", "triton"],
        help="generation.decode_attention (default: the engine's, auto)",
    )
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="prompt lengths drawn from [prompt_len / 4, prompt_len], as real data has them (with --skip-hf)",
    )
    parser.add_argument(
        "--samples-per-prompt",
        type=int,
        default=1,
        help="each prompt in this many neighbouring rows, as GRPO's groups (the engine prefills it once)",
    )
    parser.add_argument(
        "--decode-weights",
        choices=("same", "fp8"),
        default="same",
        help="generation.decode_weights: fp8 = the MLP and output layer of decode steps in FP8",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=("auto", "fp8"),
        default="auto",
        help="generation.kv_dtype: fp8 = an e4m3 KV cache with a scale per slot and head (Triton decode attention)",
    )
    parser.add_argument(
        "--decode-gemm",
        choices=("auto", "cublas", "splitk"),
        default="auto",
        help="generation.decode_gemm: splitk = decode's proj and fc2 by the split-K Triton kernel (auto: on GPUs)",
    )
    parser.add_argument(
        "--token-choice",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="generation.token_choice: triton = greedy / plain sampling by two Triton kernels (auto: on GPUs)",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    a = parser.parse_args(argv)
    if sum(map(bool, (a.tiny, a.preset, a.hf_config))) > 1:
        parser.exit(2, "bench_generation: --tiny, --preset and --hf-config each name the model: give one\n")
    if a.hf_config:
        if not a.skip_hf:
            parser.exit(2, "bench_generation: --hf-config times the native engine only: add --skip-hf\n")
        try:
            model_from_hf_config(a.hf_config)  # a mistake is one line here, before anything is built
        except ValueError as exc:
            parser.exit(2, f"bench_generation: {exc}\n")
    if a.ragged and not a.skip_hf:
        parser.exit(2, "bench_generation: --ragged compares the native engine only: add --skip-hf\n")
    bad_groups = [B for B in a.batch_sizes or () if a.samples_per_prompt < 1 or B % a.samples_per_prompt]
    if a.samples_per_prompt < 1 or bad_groups:
        parser.exit(2, f"bench_generation: --samples-per-prompt {a.samples_per_prompt} must divide every batch size\n")
    args = BenchArgs(
        batch_sizes=tuple(a.batch_sizes or ((2, 4) if a.tiny else (64, 256))),
        prompt_len=a.prompt_len or (16 if a.tiny else 128),
        new_tokens=a.new_tokens or (16 if a.tiny else 256),
        tiny=a.tiny,
        preset=a.preset or "1b",
        hf_config=a.hf_config,
        skip_hf=a.skip_hf,
        hf_compile=not (a.hf_no_compile or a.tiny),
        profile=a.profile,
        profile_kernels=a.profile_kernels,
        decode_attention=a.decode_attention,
        decode_weights=a.decode_weights,
        kv_dtype=a.kv_dtype,
        decode_gemm=a.decode_gemm,
        token_choice=a.token_choice,
        ragged=a.ragged,
        samples_per_prompt=a.samples_per_prompt,
    )
    try:
        report = run(args)
    finally:
        from aligner.parallel import shutdown

        shutdown()
    print(format_table(report))
    if "profile" in report:
        print(format_generate_profile(report["profile"]))
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
        os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main())
