"""Serve the PPO critic (value model) and the reward over PyTriton: the critic job of aligner.

    srun -n M python scripts/serve_ppo_critic.py --config-name ppo_critic [key=value ...]
    torchrun --nproc-per-node M scripts/serve_ppo_critic.py ...      (or mpiexec -n M, or plain python for one rank)
    python scripts/serve_ppo_critic.py --config-name ppo_critic_demo  (the CPU demo)

Every rank holds its TP/PP/DP slice of the models; rank 0 runs the server (endpoints and tensors: docs/CRITIC.md).
Prints `critic server ready at http://HOST:PORT ...` when it answers; stops cleanly on SIGTERM/SIGINT.
"""

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from aligner.config import ConfigError  # noqa: E402
from aligner.config.critic import CriticJobConfig, load_critic_config  # noqa: E402
from aligner.config.help import config_help, wants_help  # noqa: E402


def main(argv) -> int:
    if wants_help(argv):  # every config key, its value and its meaning, from the schema
        print(config_help(CriticJobConfig, argv, "ppo_critic", __doc__))
        return 0
    from aligner.utils.logs import setup_logging

    setup_logging(logging.WARNING)  # the job's format; ranks other than 0 only from ERROR up
    try:
        cfg = load_critic_config(argv, default_name="ppo_critic")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2

    from aligner.critic.auth import AuthError, is_loopback, load_token
    from aligner.critic.server import PortInUseError, check_ports_free, serve
    from aligner.parallel.launch import discover, initialize_job, shutdown
    from aligner.utils.net import PortSliceError

    try:
        info = discover(master_addr=cfg.parallel.master_addr, master_port=cfg.parallel.master_port)
        cfg.validate_world(info.world_size)

        if load_token(cfg.server.token_file) is None and not is_loopback(cfg.server.host):
            raise ConfigError(
                "server.host",
                f"{cfg.server.host!r} is reachable from other machines, and the critic's endpoints change its state: "
                "give the run's secret in ALIGNER_CRITIC_TOKEN (the launchers do) or server.token_file",
            )
    except (ConfigError, AuthError, PortSliceError) as exc:
        print(exc, file=sys.stderr)
        return 2
    if info.rank == 0:
        try:
            check_ports_free(cfg.server)  # before the models are built: fail in a second, naming the port
        except PortInUseError as exc:
            print(f"critic server failed: {exc}", file=sys.stderr)
            return 1
    initialize_job(cfg.parallel, cfg.seed)
    from aligner.checkpoint.dist_ckpt import CheckpointError
    from aligner.utils.lock import LockError, hold_for_job

    code = 1  # an exception below: its traceback, then exit 1
    try:
        lock = hold_for_job(cfg.exp_dir, "the critic job")  # noqa: F841 - held until the process ends
        from aligner.critic.service import CriticService

        code = serve(lambda: CriticService(cfg), cfg)  # rank 0 builds it while Triton starts
    except (ConfigError, LockError, CheckpointError) as exc:  # CheckpointError: e.g. one the config does not describe
        print(exc, file=sys.stderr)
        code = 2
    finally:
        shutdown(exit_code_if_stuck=code)
    return code


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main(sys.argv[1:]))
