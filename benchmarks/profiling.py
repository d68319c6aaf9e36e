"""A top-kernels table of one call under torch.profiler, shared by the benchmarks' `--profile` options.

Each kernel's own device time (a CPU op's device time is its kernels', counted once under the kernels' names), its
calls and share, plus a coarse split by kind (GEMM, attention, normalisation, the rest) read from kernel names, so a
reader sees at once where a step's GPU time goes. On CPU (smoke runs) the CPU ops' own time stands in.
"""

from __future__ import annotations

import time

import torch

from aligner.utils.profiling import kind_of, time_by_kind


def profile_call(fn, device: torch.device, top: int = 15) -> dict:
    """Run `fn()` once under the profiler (the caller warms up first): top kernels and the split by kind."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        fn()
        if gpu:
            torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()
    if gpu:  # the kernels themselves (a CPU op's device time is its kernels': counting both would count twice)
        rows = [
            (e.key, e.count, e.self_device_time_total / 1e3)
            for e in events
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
        ]
    else:
        rows = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in events if e.self_cpu_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows) or 1.0
    kinds = time_by_kind([(name, ms) for name, _, ms in rows])
    return {
        "wall_ms": wall_ms,
        "device_ms_total": total,
        "kernels": [
            {"name": name[:120], "calls": calls, "ms": ms, "share": ms / total, "kind": kind_of(name)}
            for name, calls, ms in rows[:top]
        ],
        "by_kind": {k: {"ms": v, "share": v / total} for k, v in kinds.items()},
    }


def format_profile(prof: dict, title: str) -> str:
    lines = [
        f"\nprofile: {title}: wall {prof['wall_ms']:.1f} ms, kernel time {prof['device_ms_total']:.1f} ms",
        "  by kind: " + ", ".join(f"{k} {v['ms']:.1f} ms ({v['share']:.0%})" for k, v in prof["by_kind"].items()),
        f"{'kernel':<90}{'kind':>18}{'calls':>8}{'ms':>10}{'share':>8}",
    ]
    for k in prof["kernels"]:
        lines.append(f"{k['name'][:88]:<90}{k['kind']:>18}{k['calls']:>8}{k['ms']:>10.2f}{k['share']:>8.1%}")
    return "\n".join(lines)
