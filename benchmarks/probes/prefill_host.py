"""Probe (issue 17, twenty-third session): how long the host takes to launch a prefill, against its end on the GPU.

The engine's prefill (decoder.prefill, no CUDA graph) of B prompts of 128 tokens of the benchmark model: after a
synchronize, the host's time until the call returns (every launch queued) and until the GPU has finished. Where the
two are close, the host sets the pace (what the prefill graphs, generation.prefill_graph_max_tokens, remove).
Repeats after two warm-up calls. `--profile N`: then one prefill of each size under torch.profiler, its N
longest-running kernels and the split by kind (benchmarks.profiling; the engine replays 256 prompts of 128 tokens
as two graphs of 128 prompts, generation.prefill_graph_max_tokens).

    python3 benchmarks/probes/prefill_host.py --decode-weights fp8 --out result.json     (CUDA)
    python3 benchmarks/probes/prefill_host.py --decode-weights fp8 --kv-dtype fp8 --batch-sizes 128 --profile 25
"""

import os
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, engine_parser, write_report  # noqa: E402
from benchmarks.profiling import format_profile, profile_call  # noqa: E402


def main(argv=None) -> dict:
    parser = engine_parser(__doc__, repeats=10)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="one profiled prefill: its N top kernels")
    args = parser.parse_args(argv)

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
        if args.profile:
            with torch.no_grad():
                prof = profile_call(partial(engine.decoder.prefill, prompts, lengths), device, args.profile)
            report[str(B)]["profile"] = prof
            print(format_profile(prof, f"one prefill of {B} prompts of 128 tokens (no graph)"))
        print(
            f"B={B} host ms "
            + " ".join(f"{h:.1f}" for h in host)
            + " | total ms "
            + " ".join(f"{t:.1f}" for t in total)
        )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
