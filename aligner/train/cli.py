"""The three trainers' entry-point body (scripts/train_{sft,reward_model,dpo}.py call `run`): parse the config ->
check it against the world size -> initialise the communicators -> build the task -> run the loop -> shut down.

A config error (before or after initialisation) or a DataError is one line on stderr and exit code 2 on every
rank (every rank reads the same config and files); anything else is a traceback and exit 1. The logging rank prints
`metrics: <path>` last (unless ALIGNER_NO_METRICS_LINE is set: a launcher that prints it itself).
Nothing heavy is imported before the config is valid: a bad command line fails in well under a second.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Sequence

from aligner.config.errors import ConfigError
from aligner.data.rows import DataError


def run(name: str, argv: Sequence[str], load_config: Callable, build: Callable) -> int:
    """`load_config(argv) -> cfg`; `build(cfg) -> task` (aligner.train.loop.Task), called after initialisation."""
    from aligner.utils.logs import setup_logging

    setup_logging()
    try:
        cfg = load_config(argv)
        from aligner.parallel import discover

        p = cfg.parallel
        cfg.validate_world(discover(master_addr=p.master_addr, master_port=p.master_port).world_size)
    except ConfigError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    from aligner.parallel import initialize_job, shutdown
    from aligner.train.loop import SupervisedLoop

    initialize_job(cfg.parallel, cfg.seed)
    code = 1  # an exception below: its traceback, then exit 1
    try:
        metrics_path = SupervisedLoop(cfg, build(cfg), name).fit()
        if metrics_path and not os.environ.get("ALIGNER_NO_METRICS_LINE"):
            print(f"metrics: {os.path.abspath(metrics_path)}", flush=True)
        code = 0
    except (ConfigError, DataError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        code = 2
    finally:
        shutdown(exit_code_if_stuck=code)
    return code
