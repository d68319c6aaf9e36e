"""Probe (issue 17, twenty-third session): how long the host takes to launch a prefill, against its end on the GPU.

The engine's prefill (decoder.prefill, no CUDA graph) of B prompts of 128 tokens of the benchmark model: after a
synchronize, the host's time until the call returns (every launch queued) and until the GPU has finished. Where the
two are close, the host sets the pace (what the prefill graphs, generation.prefill_graph_max_tokens, remove).
Repeats after two warm-up calls.

    python3 benchmarks/probes/prefill_host.py --decode-weights fp8 --out result.json     (CUDA)
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode-weights", default="same", help="generation.decode_weights (same | fp8)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    args = parser.parse_args(argv)

    from aligner.generation import GenerationConfig, build_engine
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize
    from benchmarks.generation import BENCH_MODEL

    initialize(1, 1)
    torch.manual_seed(0)
    policy = build_gpt(BENCH_MODEL).eval()
    device = next(policy.parameters()).device
    gen = GenerationConfig(
        max_batch_size=max(args.batch_sizes), max_prompt_length=128, max_response_length=256,
        decode_weights=args.decode_weights,
    )  # fmt: skip
    engine = build_engine(gen, BENCH_MODEL, policy)
    report = {"device": torch.cuda.get_device_name(device), "args": vars(args)}
    for B in args.batch_sizes:
        prompts = torch.randint(0, BENCH_MODEL.vocab_size, (B, 128), device=device)
        lengths = torch.full((B,), 128, device=device)
        host, total = [], []
        with torch.no_grad():
            for i in range(args.repeats + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.decoder.prefill(prompts, lengths)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if i >= 2:
                    host.append((t1 - t0) * 1e3)
                    total.append((t2 - t0) * 1e3)
        report[str(B)] = {"host_ms": host, "total_ms": total}
        print(
            f"B={B} host ms "
            + " ".join(f"{h:.1f}" for h in host)
            + " | total ms "
            + " ".join(f"{t:.1f}" for t in total)
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
