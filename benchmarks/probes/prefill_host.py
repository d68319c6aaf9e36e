"""Probe (issue 17, twenty-third session): how long the host takes to launch a prefill, against its end on the GPU.

The engine's prefill (decoder.prefill, no CUDA graph) of B prompts of 128 tokens of the benchmark model: after a
synchronize, the host's time until the call returns (every launch queued) and until the GPU has finished. Where the
two are close, the host sets the pace (what the prefill graphs, generation.prefill_graph_max_tokens, remove).
Repeats after two warm-up calls.

    python3 benchmarks/probes/prefill_host.py --decode-weights fp8 --out result.json     (CUDA)
"""

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, engine_parser, write_report  # noqa: E402


def main(argv=None) -> dict:
    args = engine_parser(__doc__, repeats=10).parse_args(argv)

    from benchmarks.generation import BENCH_MODEL

    engine, device = bench_engine(args, BENCH_MODEL, 128, 256)
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
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
