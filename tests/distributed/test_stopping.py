"""The training loops' stop decision (aligner.parallel.stopping): one rank's signal or spent time budget stops
every rank after the same step (real processes over gloo)."""

import os
import signal

from dist import run_ranks


def _decisions(rank, world_size):
    from aligner.parallel.stopping import StepStopper

    stopper = StepStopper(max_time=None)
    first = stopper.after_step()  # nobody asked
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)  # the Slurm launchers' signal, to one rank only
    second = stopper.after_step()
    spent = StepStopper(max_time=0.0 if rank == 0 else 3600.0).after_step()
    return first, second, spent


def test_one_ranks_signal_or_time_budget_stops_every_rank():
    assert run_ranks(_decisions, 2) == [(None, "a stop signal", "max_time")] * 2
