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

from aligner.config.actor import ActorJobConfig, load_actor_config  # noqa: E402
from aligner.config.help import config_help, wants_help  # noqa: E402
from aligner.rewards.function import RewardFunctionError  # noqa: E402


def main(argv) -> int:
    if wants_help(argv):  # every config key, its value and its meaning, from the schema
        print(config_help(ActorJobConfig, argv, "ppo_actor", __doc__))
        return 0
    from aligner.critic.protocol import CriticCheckpointError
    from aligner.train.cli import run_job

    def fit(cfg):
        from aligner.ppo.trainer import PPOTrainer

        trainer = PPOTrainer(cfg)
        try:
            return trainer.fit()
        finally:
            trainer.close()

    # besides the shared ones (aligner.train.cli): a critic that cannot resume the committed step, a reward
    # function that fails (raised alike on every rank: all stop alike, at one call)
    user_errors = (CriticCheckpointError, RewardFunctionError)
    memory_hint = (
        "lower ppo.micro_batch_size (training) or ppo.forward_micro_batch_size (log-probs), generation.max_batch_size "
        "(rollouts at once), or set generation.release_kv_cache=true, generation.kv_dtype=fp8, "
        "model.recompute=selective|full; with the critic on the same GPUs, give it GPUs of its own (docs/PPO.md)"
    )
    return run_job("train_ppo_actor", argv, load_actor_config, fit, "the actor job", user_errors, memory_hint)


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main(sys.argv[1:]))
