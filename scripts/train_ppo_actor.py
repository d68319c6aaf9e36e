"""The actor job: PPO on the policy, against a running critic job.

    srun -n N python scripts/train_ppo_actor.py --config-name ppo_actor [key=value ...]
    torchrun --nproc-per-node N scripts/train_ppo_actor.py ...   |   mpiexec -n N python scripts/train_ppo_actor.py ...

Prints `metrics: <path of metrics.jsonl>` last (rank 0).
"""

import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config import ConfigError  # noqa: E402
from aligner.config.actor import load_actor_config  # noqa: E402


def main(argv) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_actor_config(argv)
    except ConfigError as exc:
        print(f"train_ppo_actor: {exc}", file=sys.stderr)
        return 2
    from aligner.parallel import initialize, shutdown
    from aligner.ppo.trainer import PPOTrainer

    p = cfg.parallel
    initialize(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.backend,
        cfg.seed,
        p.master_addr,
        p.master_port,
        p.timeout_minutes,
    )
    try:
        metrics_path = PPOTrainer(cfg).fit()
        if metrics_path and not os.environ.get("ALIGNER_NO_METRICS_LINE"):  # a launcher prints it last itself
            print(f"metrics: {os.path.abspath(metrics_path)}", flush=True)
    except ConfigError as exc:
        print(f"train_ppo_actor: {exc}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
