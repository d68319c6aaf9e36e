"""The actor job: PPO, GRPO, RLOO or REINFORCE++ on the policy (ppo.advantage_estimator), scored by a running critic
job or by a reward function it runs itself (reward.source).

    srun -n N python scripts/train_ppo_actor.py --config-name ppo_actor [key=value ...]
    torchrun --nproc-per-node N scripts/train_ppo_actor.py ...   |   mpiexec -n N python scripts/train_ppo_actor.py ...

Prints `metrics: <path of metrics.jsonl>` last (rank 0). A config error is one line on stderr and exit code 2; so is
a reward function that fails (its line names the function and the sample; the function's traceback follows).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config import ConfigError  # noqa: E402
from aligner.config.actor import ActorJobConfig, load_actor_config  # noqa: E402
from aligner.config.help import config_help, wants_help  # noqa: E402
from aligner.data.rows import DataError  # noqa: E402
from aligner.rewards.function import RewardFunctionError  # noqa: E402


def main(argv) -> int:
    if wants_help(argv):  # every config key, its value and its meaning, from the schema
        print(config_help(ActorJobConfig, argv, "ppo_actor", __doc__))
        return 0
    from aligner.utils.logs import setup_logging

    setup_logging()
    try:
        cfg = load_actor_config(argv)
        from aligner.parallel import discover

        p = cfg.parallel
        cfg.validate_world(discover(master_addr=p.master_addr, master_port=p.master_port).world_size)
    except ConfigError as exc:
        print(f"train_ppo_actor: {exc}", file=sys.stderr)
        return 2
    from aligner.checkpoint.dist_ckpt import CheckpointError
    from aligner.critic.protocol import CriticCheckpointError
    from aligner.parallel import initialize_job, shutdown
    from aligner.ppo.trainer import PPOTrainer
    from aligner.utils.lock import LockError, hold_for_job

    # A user's mistake or a state to fix by hand: one line, exit 2 (anything else is a bug: traceback, exit 1).
    user_errors = (ConfigError, DataError, CheckpointError, CriticCheckpointError, LockError, RewardFunctionError)

    initialize_job(cfg.parallel, cfg.seed)
    code = 1  # an exception below: its traceback, then exit 1
    try:
        lock = hold_for_job(cfg.exp_dir, "the actor job")  # noqa: F841 - held until the process ends
        trainer = PPOTrainer(cfg)
        try:
            metrics_path = trainer.fit()
        finally:
            trainer.close()
        if metrics_path and not os.environ.get("ALIGNER_NO_METRICS_LINE"):  # a launcher prints it last itself
            print(f"metrics: {os.path.abspath(metrics_path)}", flush=True)
        code = 0
    except user_errors as exc:  # raised alike on every rank: all stop alike (a reward function: at one call)
        print(f"train_ppo_actor: {exc}", file=sys.stderr)
        code = 2
    finally:
        shutdown(exit_code_if_stuck=code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
