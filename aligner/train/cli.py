"""The training jobs' entry-point body: parse the config -> check it against the world size -> initialise the
communicators -> take the experiment directory's lock -> train -> shut down. `run_job` serves the PPO actor
(scripts/train_ppo_actor.py) and, through `run`, the supervised trainers (scripts/train_{sft,reward_model,dpo}.py).

A user's mistake or a state to fix by hand is one line on stderr and exit code 2 on every rank (every rank reads the
same config and files and raises alike): a config error (before or after initialisation), a bad dataset line, a
checkpoint that cannot be resumed, an experiment directory another run holds, and what the caller adds. Anything
else is a bug of ours: a traceback and exit 1. Running out of GPU memory is a traceback and exit 1 too, followed by
one line that names the job's settings that take less (`memory_hint`). The logging rank prints `metrics: <path>`
last (unless ALIGNER_NO_METRICS_LINE is set: a launcher that prints it itself). Nothing heavy is imported before
the config is valid: a bad command line fails in well under a second.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable, Sequence

from aligner.config.errors import ConfigError
from aligner.data.rows import DataError
from aligner.utils.net import PortSliceError


def run_job(
    name: str,
    argv: Sequence[str],
    load_config: Callable,
    fit: Callable,
    what: str,
    user_errors: tuple[type[BaseException], ...] = (),
    memory_hint: str = "smaller micro-batches take less",
) -> int:
    """`load_config(argv) -> cfg`; `fit(cfg) -> metrics path or None`, called after initialisation with the lock on
    `cfg.exp_dir` held (`what` names the job in the lock, for a second run's error; `memory_hint` the settings to
    lower when it runs out of GPU memory)."""
    from aligner.utils.logs import setup_logging

    setup_logging()
    try:
        cfg = load_config(argv)
        from aligner.parallel import discover

        p = cfg.parallel
        cfg.validate_world(discover(master_addr=p.master_addr, master_port=p.master_port).world_size)
    except (ConfigError, PortSliceError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    from aligner.checkpoint.dist_ckpt import CheckpointError
    from aligner.parallel import initialize_job, shutdown
    from aligner.utils.lock import LockError, hold_for_job

    initialize_job(cfg.parallel, cfg.seed)
    import torch

    code = 1  # an exception below: its traceback, then exit 1
    try:
        lock = hold_for_job(cfg.exp_dir, what)  # noqa: F841 - held until the process ends
        metrics_path = fit(cfg)
        if metrics_path and not os.environ.get("ALIGNER_NO_METRICS_LINE"):
            print(f"metrics: {os.path.abspath(metrics_path)}", flush=True)
        code = 0
    except (ConfigError, DataError, CheckpointError, LockError, *user_errors) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        code = 2
    except torch.OutOfMemoryError as exc:  # the traceback says where; the last line what to change
        traceback.print_exc()
        what = ". ".join(str(exc).strip().splitlines()[0].split(". ")[:3])  # the request, the GPU's total and free
        print(f"{name}: out of GPU memory ({what}); {memory_hint}", file=sys.stderr)
    finally:
        shutdown(exit_code_if_stuck=code)
    return code


SUPERVISED_MEMORY_HINT = (
    "lower train.micro_batch_size (train.global_batch_size stays: more micro-batches a step), or set "
    "model.recompute=selective|full"
)


def run(name: str, argv: Sequence[str], load_config: Callable, build: Callable) -> int:
    """A supervised trainer: `build(cfg) -> task` (aligner.train.loop.Task), run by the shared loop."""

    def fit(cfg):
        from aligner.train.loop import SupervisedLoop

        return SupervisedLoop(cfg, build(cfg), name).fit()

    return run_job(name, argv, load_config, fit, f"the {name} job", memory_hint=SUPERVISED_MEMORY_HINT)
