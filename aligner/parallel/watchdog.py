"""A job-level watchdog: no phase of a step may hang silently.

A collective that never completes is normally ended by its process group's timeout (`parallel.timeout_minutes`):
gloo raises in the waiting call, NCCL's watchdog names the rank, group and operation. But a rank can also wait
outside a collective's `wait()` (in a CUDA synchronize behind a stuck NCCL kernel: seen on 2x H200, where NCCL's
watchdog reported the timeout and the process still did not end), or in something that is not a collective at all.
So the trainers run each phase under `PhaseWatchdog.phase(name)`; a phase that lasts longer than `timeout_s` ends the
process with exit code 1, after one line naming the rank, the step and the phase, and a dump of every thread's stack
(stderr). The launcher then sees a failed job instead of one that holds its allocation forever.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable


class PhaseWatchdog:
    def __init__(self, timeout_s: float, where: Callable[[], str] = lambda: "", poll_s: float = 1.0):
        self.timeout_s, self.where, self.poll_s = timeout_s, where, poll_s
        self._phases: list[tuple[str, float]] = []  # nested phases, innermost last
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="aligner-watchdog", daemon=True).start()

    @contextmanager
    def phase(self, name: str):
        """Time `name` (the innermost open phase is the one watched: an outer phase is the sum of inner ones)."""
        with self._lock:
            self._phases.append((name, time.monotonic()))
        try:
            yield
        finally:
            with self._lock:
                self._phases.pop()
                if self._phases:  # the outer phase's own time restarts: only time spent outside inner ones counts
                    outer, _ = self._phases[-1]
                    self._phases[-1] = (outer, time.monotonic())

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                current = self._phases[-1] if self._phases else None
                names = "/".join(n for n, _ in self._phases)
            if current is not None and time.monotonic() - current[1] > self.timeout_s:
                name = names
                print(
                    f"watchdog: {self.where()} phase '{name}' has run for more than {self.timeout_s:g} s "
                    "(parallel.timeout_minutes): a collective or a peer is stuck; ending this process. Stacks:",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(1)
