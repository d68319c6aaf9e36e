"""Probe (issue 17, twenty-third session): one engine, the same prompts, N timed greedy generate calls per batch size.

bench_generation.py times one call per batch size; at B=64 its prefill figure moved between ~20 and ~34 ms from call
to call (its host time near the kernels' time: prefill_host.py). Here every call's tokens/s, prefill ms and decode
ms per step are kept, with their median and best, for the benchmark model (or --tiny on the CPU), prompts of 128
tokens and 256 new tokens as bench_generation.py draws them.

    python3 benchmarks/probes/generate_repeats.py --decode-weights fp8 --repeats 9 --out result.json
    python3 benchmarks/probes/generate_repeats.py --prefill-graph-max-tokens 0 ...    (prefill without CUDA graphs)
    python3 benchmarks/probes/generate_repeats.py --samples-per-prompt 8 --batch-sizes 512 [--prefill-each-row] ...
        (GRPO's groups: each prompt prefilled once, or every row)
    python3 benchmarks/probes/generate_repeats.py --decode-weights fp8 --kv-dtype fp8 \
        --set triton_decode.FP8_MAXNREG=128 triton_decode.EXP2=True ...     (candidate settings, same tree)
"""

import argparse
import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, engine_choices, engine_parser, write_report  # noqa: E402


def medians(row: dict) -> dict:
    """A batch size's row of the report: the median of each per-call list (tok_s, prefill_ms, decode_ms)."""
    return {k: statistics.median(v) for k, v in row.items() if isinstance(v, list)}


def main(argv=None) -> dict:
    parser = engine_parser(__doc__, repeats=9)
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=None, help="default: the config's")
    parser.add_argument("--tiny", action="store_true", help="bench_generation's 2-layer model (CPU smoke run)")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="each prompt in n neighbouring rows")
    parser.add_argument(
        "--prefill-each-row", action="store_true", help="generation.prefill_repeats_once=false: repeats prefilled too"
    )
    args = parser.parse_args(argv)

    from aligner.generation import SamplingParams
    from benchmarks.generation import _prompts, _timed, bench_model

    cfg = bench_model("tiny" if args.tiny else args.preset)
    prompt_len, new_tokens = (16, 16) if args.tiny else (128, 256)
    extra = {} if args.prefill_graph_max_tokens is None else {"prefill_graph_max_tokens": args.prefill_graph_max_tokens}
    if args.prefill_each_row:
        extra["prefill_repeats_once"] = False
    engine, device = bench_engine(args, cfg, prompt_len, new_tokens, **extra)
    prompt_args = argparse.Namespace(prompt_len=prompt_len, ragged=False, samples_per_prompt=args.samples_per_prompt)
    rng = torch.Generator().manual_seed(1)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": vars(args)}
    report["engine"] = engine_choices(engine)
    print("engine:", ", ".join(f"{k} {v}" for k, v in report["engine"].items()), flush=True)
    for B in args.batch_sizes:
        prompts, lengths = _prompts(prompt_args, B, cfg.vocab_size, rng, device)
        sp = SamplingParams(greedy=True, ignore_eos=True)
        engine.generate(prompts, lengths, sp)  # warm-up: captures the graphs
        row = {"tok_s": [], "prefill_ms": [], "decode_ms": []}
        row["prefill_prompts"] = engine.last_timings["prefill_prompts"]
        for _ in range(args.repeats):
            _, seconds = _timed(partial(engine.generate, prompts, lengths, sp), device)
            t = engine.last_timings
            row["tok_s"].append(B * new_tokens / seconds)
            row["prefill_ms"].append(t["prefill_ms"])
            row["decode_ms"].append(t["decode_ms"] / max(1, t["decode_steps"]))
        report[str(B)] = row
        med = medians(row)
        print(
            f"B={B} ({row['prefill_prompts']} prompts prefilled) tok/s median {med['tok_s']:.0f} best "
            f"{max(row['tok_s']):.0f} | prefill ms median "
            f"{med['prefill_ms']:.2f} best {min(row['prefill_ms']):.2f} | decode ms median {med['decode_ms']:.4f} "
            f"best {min(row['decode_ms']):.4f}",
            flush=True,
        )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
