"""One step of a job under torch.profiler (`logging.profile_step`): a trace and a per-phase summary per rank.

Contract: the loop wraps the chosen step in `StepProfiler(out_dir, step, rank, gpu, timer)`; while it is open the
timer's phases are also profiler ranges (`phase/<name>`), so they show as named spans in the trace. On exit it
writes `<out_dir>/step<N>-rank<R>.json.gz` (a Chrome trace: Perfetto or chrome://tracing open it) and
`step<N>-rank<R>.summary.json`, logs a table and keeps the summary: for each phase its wall time, the time the
device was busy with kernels during it (the union of kernel intervals, so overlapping streams count once), its
kernel time by kind (GEMM, attention, communication, ...) and its top kernels. A phase whose device is idle for
much of its wall time waits on the host (kernel launches, host syncs, the other job sharing the GPU) rather than
computing. The timer synchronises the device at phase boundaries, so a kernel belongs to the phase whose window
holds it. The profiler's own per-op cost slows host-bound stretches: compare the profiled step's phase times with
an unprofiled step's. On CPU there are no kernels: busy time is None and the top entries are CPU ops (self time
over the whole step). Files are written to a temporary name, then renamed.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import nullcontext

log = logging.getLogger(__name__)

PHASE = "phase/"

# substrings of kernel names, first match wins (cuBLAS GEMMs are "nvjet_*"/"sm90_xmma_gemm*"/"cutlass*" on H200)
KINDS = (
    ("communication", ("nccl", "gloo")),
    ("attention", ("flash", "fmha", "attention", "badd", "softmax")),
    ("gemm", ("nvjet", "gemm", "cutlass", "cublas", "addmm", "aten::mm", "aten::bmm", "matmul")),
    ("norm", ("norm",)),
    ("copy/cast", ("copy", "cast", "aten::cat", "catarray", "fill")),
)


def kind_of(name: str) -> str:
    """A kernel's (or CPU op's) kind, read from its name: attention, gemm, norm, copy/cast or other elementwise."""
    low = name.lower()
    for kind, needles in KINDS:
        if any(n in low for n in needles):
            return kind
    return "other elementwise"


def busy_time(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `intervals` clipped to [start, end] (same units): time something ran."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in intervals if b > start and a < end)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _top(rows: list[tuple[str, float]], n: int) -> list[dict]:
    by_name: dict[str, list[float]] = {}
    for name, us in rows:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:n]
    return [{"name": k[:120], "kind": kind_of(k), "calls": c, "ms": us / 1e3} for k, (c, us) in ranked]


def time_by_kind(rows: list[tuple[str, float]]) -> dict[str, float]:
    """(name, time) rows summed by kind_of(name), largest first (same unit as given)."""
    kinds: dict[str, float] = {}
    for name, t in rows:
        kinds[kind_of(name)] = kinds.get(kind_of(name), 0.0) + t
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def summarize(events, gpu: bool, top: int = 8) -> dict:
    """Per-phase wall, busy and top kernels from a profiler's `events()` (FunctionEvents, times in us)."""
    from torch.autograd import DeviceType

    phases, kernels, cpu_ops = [], [], []
    for e in events:
        if e.device_type == DeviceType.CUDA:
            # Device-side annotations (a phase's range, c10d's "nccl:all_reduce" around its kernels) are no kernels:
            # counting them would count that time twice.
            if not (getattr(e, "is_user_annotation", False) or e.name.startswith(PHASE)):
                kernels.append((e.time_range.start, e.time_range.end, e.name))
        elif e.name.startswith(PHASE):
            phases.append((e.name[len(PHASE) :], e.time_range.start, e.time_range.end))
        elif not gpu and e.self_cpu_time_total > 0:
            cpu_ops.append((e.name, e.self_cpu_time_total))
    out: dict[str, dict] = {}
    for name, a, b in sorted(phases, key=lambda p: p[1]):
        entry = out.setdefault(name, {"wall_ms": 0.0, "busy_ms": 0.0 if gpu else None, "windows": []})
        entry["wall_ms"] += (b - a) / 1e3
        entry["windows"].append((a, b))
    for entry in out.values():
        windows = entry.pop("windows")
        if gpu:
            inside = [k for k in kernels if any(a <= k[0] < b for a, b in windows)]
            entry["busy_ms"] = sum(busy_time([(s, e) for s, e, _ in inside], a, b) for a, b in windows) / 1e3
            entry["busy_share"] = entry["busy_ms"] / entry["wall_ms"] if entry["wall_ms"] else 0.0
            rows = [(n, e - s) for s, e, n in inside]
            entry["top"] = _top(rows, top)
            entry["by_kind_ms"] = time_by_kind([(n, us / 1e3) for n, us in rows])
    step_top = _top([(n, e - s) for s, e, n in kernels], top) if gpu else _top(cpu_ops, top)
    return {"phases": out, "top": step_top, "device": "cuda" if gpu else "cpu"}


def format_summary(summary: dict, title: str) -> str:
    lines = [title, f"{'phase':<22}{'wall ms':>10}{'busy ms':>10}{'busy':>7}  top kernel"]
    for name, p in summary["phases"].items():
        busy = "-" if p["busy_ms"] is None else f"{p['busy_ms']:.1f}"
        share = "-" if p["busy_ms"] is None else f"{p['busy_share']:.0%}"
        top = p.get("top") or [{"name": "-", "ms": 0.0}]
        lines.append(
            f"{name:<22}{p['wall_ms']:>10.1f}{busy:>10}{share:>7}  {top[0]['name'][:60]} ({top[0]['ms']:.1f} ms)"
        )
    return "\n".join(lines)


def _write_atomic(path: str, write) -> None:
    head, tail = os.path.split(path)
    tmp = os.path.join(head, f".tmp{os.getpid()}-{tail}")  # the suffix kept: torch gzips a trace named *.gz
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class StepProfiler:
    """Profile one step (see the module docstring); `summary` holds the result after the `with` block."""

    def __init__(self, out_dir: str, step: int, rank: int, gpu: bool, timer):
        self.out_dir, self.step, self.rank, self.gpu, self.timer = out_dir, step, rank, gpu, timer
        self.summary: dict | None = None
        self.trace_path = os.path.join(out_dir, f"step{step}-rank{rank}.json.gz")
        self.summary_path = os.path.join(out_dir, f"step{step}-rank{rank}.summary.json")

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.gpu else [])
        self._prof = profile(activities=activities)
        self.timer.annotate = lambda name: record_function(PHASE + name)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._prof.__exit__(*exc)
        finally:
            self.timer.annotate = None
        if exc[0] is not None:
            return False
        os.makedirs(self.out_dir, exist_ok=True)
        _write_atomic(self.trace_path, self._prof.export_chrome_trace)
        self.summary = summarize(self._prof.events(), self.gpu)
        self.summary |= {"step": self.step, "rank": self.rank, "trace": self.trace_path}

        def dump(path):
            with open(path, "w") as f:
                json.dump(self.summary, f, indent=1)

        _write_atomic(self.summary_path, dump)
        log.info(
            "%s", format_summary(self.summary, f"profile of step {self.step}, rank {self.rank}: {self.trace_path}")
        )
        return False


def profiler_for(logging_cfg, exp_dir: str, step: int, rank: int, gpu: bool, timer):
    """A StepProfiler writing under <exp_dir>/profile when `step` is `logging.profile_step` and `rank` is one of
    `logging.profile_ranks`; a null context otherwise."""
    if step != logging_cfg.profile_step or rank not in logging_cfg.profile_ranks:
        return nullcontext()
    return StepProfiler(os.path.join(exp_dir, "profile"), step, rank, gpu, timer)
