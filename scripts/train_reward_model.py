"""Reward-model training (Bradley-Terry) on preference pairs.

    python scripts/train_reward_model.py --config-name reward_model_demo [key=value ...]     # the CPU demo
    python scripts/train_reward_model.py [key=value ...]                            # conf/reward_model.yaml
    torchrun --nproc-per-node N scripts/train_reward_model.py ...      # or srun -n N / mpiexec -n N python ...
    python launchers/local/train.py --trainer reward_model --procs N ...
    sbatch launchers/slurm/train.sbatch --trainer reward_model ...

Every key, its default and its meaning: aligner/config/reward_model.py and aligner/config/train.py; docs/TRAINERS.md.
Writes <exp_dir>/metrics.jsonl and checkpoints; prints `metrics: <path>` last. A config or data error is one
line on stderr and exit code 2; SIGTERM (or max_time) checkpoints and exits 0; rerunning resumes.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config.reward_model import load_reward_model_config  # noqa: E402
from aligner.train.cli import run  # noqa: E402


def build(cfg):
    from aligner.train.reward_model import RewardModelTask  # torch and megatron: only once the config is valid

    return RewardModelTask(cfg)


def main(argv) -> int:
    return run("train_reward_model", argv, load_reward_model_config, build)


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main(sys.argv[1:]))
