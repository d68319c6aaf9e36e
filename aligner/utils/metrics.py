"""Metrics: one flat namespace per step (`rollout/reward_mean`, `ppo/kl`, `timing/generate`, ...), written as JSONL
(`<exp_dir>/metrics.jsonl`, one object per line, appended and flushed each step) and to TensorBoard, plus a timer.

Only the logging rank writes. On resume, lines for steps at or after the resumed step are dropped first, so the
file reads as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import os
import time
from contextlib import contextmanager, nullcontext


class Timer:
    """Accumulates wall-clock seconds per name (`timing/<name>`); `sync` is called before reading the clock so
    device work is counted where it was issued; with `watch`, every timed phase is also watched for hangs; while
    `annotate` is set (aligner.utils.profiling.StepProfiler), every phase is also a profiler range."""

    def __init__(self, sync=None, watch=None):
        self.sync = sync or (lambda: None)
        self.watch = watch  # an object with a `phase(name)` context (aligner.parallel.watchdog), or None
        self.annotate = None  # a `name -> context` while a step is profiled, else None
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        with (
            self.watch.phase(name) if self.watch is not None else nullcontext(),
            self.annotate(name) if self.annotate is not None else nullcontext(),
        ):
            self.sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self.sync()
                self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        out = {f"timing/{k}": v for k, v in self.totals.items()}
        self.totals = {}
        return out


def _clean(value):
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


class MetricsWriter:
    def __init__(self, exp_dir: str, enabled: bool = True, tensorboard: bool = True, resume_step: int | None = None):
        self.enabled = enabled
        self.path = os.path.join(exp_dir, "metrics.jsonl")
        self.samples_path = os.path.join(exp_dir, "samples.jsonl")
        self.tb = None
        if not enabled:
            return
        os.makedirs(exp_dir, exist_ok=True)
        self._truncate(self.path, resume_step)
        self._truncate(self.samples_path, resume_step)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(exp_dir, "tensorboard"))

    @staticmethod
    def _truncate(path: str, resume_step: int | None) -> None:
        """Keep only lines of steps before `resume_step` (None: start a fresh file)."""
        if not os.path.exists(path):
            return
        kept = []
        if resume_step is not None:
            with open(path) as f:
                for line in f:
                    try:
                        if json.loads(line)["step"] < resume_step:
                            kept.append(line)
                    except (json.JSONDecodeError, KeyError):
                        continue  # a line cut by a crash
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: _clean(float(v)) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if v is not None and not (isinstance(v, float) and math.isnan(v)):
                    self.tb.add_scalar(k, float(v), step)
            self.tb.flush()

    def samples(self, step: int, rows: list[dict]) -> None:
        if not self.enabled or not rows:
            return
        with open(self.samples_path, "a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}) + "\n")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class Progress:
    """A tqdm bar on the logging rank (a no-op elsewhere or when disabled)."""

    def __init__(self, total: int, initial: int, enabled: bool, desc: str):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(**postfix)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
