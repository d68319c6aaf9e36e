"""Stopping a training job cleanly between steps, the same way on every rank.

A job stops early on SIGTERM or SIGUSR1 (the Slurm launchers' signal; srun forwards it to the tasks) or once its
`max_time` budget is spent. Ranks see a signal or the clock at different moments, so after each step they agree
(one all-reduce): if any rank wants to stop, all stop after that same step and checkpoint it together.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from aligner.parallel.device import current_device


class StepStopper:
    """Created when the loop starts (the clock of `max_time` starts then; the signal handlers are installed)."""

    def __init__(self, max_time: float | None):
        self.max_time = max_time
        self.signalled = False
        self.start = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signalled = True

    def after_step(self) -> str | None:
        """Why every rank stops now ("a stop signal", "max_time"), or None to go on. Collective."""
        out_of_time = self.max_time is not None and time.monotonic() - self.start > self.max_time
        flags = torch.tensor([float(self.signalled), float(out_of_time)], device=current_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        signalled, spent = flags.tolist()  # one device-to-host copy
        if signalled:
            return "a stop signal"
        return "max_time" if spent else None
