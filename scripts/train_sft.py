"""Supervised fine-tuning (SFT) of a policy on prompt/response or chat rows.

    python scripts/train_sft.py --config-name sft_demo [key=value ...]     # the CPU demo
    python scripts/train_sft.py [key=value ...]                            # conf/sft.yaml
    torchrun --nproc-per-node N scripts/train_sft.py ...      # or srun -n N / mpiexec -n N python ...
    python launchers/local/train.py --trainer sft --procs N ...
    sbatch launchers/slurm/train.sbatch --trainer sft ...

Every key, its default and its meaning: aligner/config/sft.py and aligner/config/train.py; docs/TRAINERS.md.
Writes <exp_dir>/metrics.jsonl and checkpoints; prints `metrics: <path>` last. A config or data error is one
line on stderr and exit code 2; SIGTERM (or max_time) checkpoints and exits 0; rerunning resumes.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config.sft import load_sft_config  # noqa: E402
from aligner.train.cli import run  # noqa: E402


def build(cfg):
    from aligner.train.sft import SFTTask  # torch and megatron: only once the config is valid

    return SFTTask(cfg)


def main(argv) -> int:
    return run("train_sft", argv, load_sft_config, build)


if __name__ == "__main__":
    from aligner.utils.exit import exit_after_main

    exit_after_main(main(sys.argv[1:]))
