"""Probe (issue 17, forty-second session): is the FP8 decode path's log-prob gap its rounding, or more?

bench_generation.py sets the engine's log-probs against megatron's forward on the generated tokens. With
`generation.decode_weights: fp8` that gap grew with the model on one H100 (random weights, 64 rows: mean 0.23 nats a
token at 1B, 1.02 at 8B; 0.55 at 8B with decode_gemm=cublas, whose copies leave qkv in bf16). Here the same gap is
also taken against megatron's forward with the engine's rounding put in (aligner.generation.native.replay: fake_fp8
for the layers the engine holds e4m3 copies of, fp8_kv_cache with an FP8 cache), and the rounded forward against the
plain one: what the rounding itself moves the log-probs by. The tests hold the engine to the rounded forward on small
models in float32 (tests/unit/test_generation_fp8.py); here the model's size and bf16 are the GPU's.

    python3 benchmarks/probes/fp8_reference.py --preset 8b --batch-sizes 64 [--kv-dtype fp8] [--out result.json]
    python3 benchmarks/probes/fp8_reference.py --tiny --batch-sizes 3      (CPU: the torch FP8 path, no qkv copies)
"""

import argparse
import contextlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, bench_policy, engine_choices, engine_parser, write_report  # noqa: E402


def engine_rounding(policy, engine):
    """rounding(prompt_length, sequence_length) for benchmarks.generation.reference_logprobs: megatron's forward of one
    sample with the engine's FP8 roundings (its weight copies' layers, its cache's dtype)."""
    from aligner.generation.native.replay import fake_fp8, fp8_kv_cache

    fp8_weights, fp8_cache = engine.decoder.fp8, engine.decoder.kv_fp8

    @contextlib.contextmanager
    def rounding(prompt_length: int, width: int):
        with contextlib.ExitStack() as stack:
            if fp8_weights is not None:
                lengths = torch.tensor([prompt_length])
                stack.enter_context(fake_fp8(policy, lengths, width, qkv=fp8_weights.has_qkv))
            if fp8_cache:
                stack.enter_context(fp8_kv_cache(policy))
            yield

    return rounding


def _pair(gap: dict) -> str:
    return f"{gap['logp_abs_diff_mean']:.4f} / {gap['logp_abs_diff_max']:.4f}"


def main(argv=None) -> dict:
    parser = engine_parser(__doc__, repeats=1)
    parser.set_defaults(decode_weights="fp8")
    parser.add_argument("--tiny", action="store_true", help="bench_generation's 2-layer model (CPU smoke run)")
    parser.add_argument("--rows", type=int, default=8, help="samples whose log-probs are compared (default 8)")
    args = parser.parse_args(argv)

    from aligner.generation import SamplingParams
    from benchmarks.generation import _prompts, bench_model, logprob_gap, reference_logprobs

    cfg = bench_model("tiny" if args.tiny else args.preset)
    prompt_len, new_tokens = (16, 16) if args.tiny else (128, 256)
    policy = bench_policy(args, cfg)
    engine, device = bench_engine(args, cfg, prompt_len, new_tokens, policy=policy)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": vars(args)}
    report["engine"] = engine_choices(engine)
    report["fp8_qkv"] = engine.decoder.fp8 is not None and engine.decoder.fp8.has_qkv
    rounding = engine_rounding(policy, engine)
    rng = torch.Generator().manual_seed(1)
    prompt_args = argparse.Namespace(prompt_len=prompt_len, ragged=False)
    for B in args.batch_sizes:
        prompts, lengths = _prompts(prompt_args, B, cfg.vocab_size, rng, device)
        out = engine.generate(prompts, lengths, SamplingParams(greedy=True, ignore_eos=True))
        plain = reference_logprobs(policy, cfg, prompts, lengths, out, args.rows)
        rounded = reference_logprobs(policy, cfg, prompts, lengths, out, args.rows, rounding=rounding)
        row = report[str(B)] = {
            "plain": logprob_gap(plain, out.logprobs_BR),
            "rounded": logprob_gap(rounded, out.logprobs_BR),
            "rounding": logprob_gap(rounded, torch.stack(plain)),  # what the rounding moves megatron's forward by
        }
        print(
            f"B={B} the engine's log-probs against megatron's forward, mean / max nats a token: plain "
            f"{_pair(row['plain'])}, with the engine's rounding {_pair(row['rounded'])}; the rounded forward against "
            f"the plain one {_pair(row['rounding'])}",
            flush=True,
        )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
