"""Run a supervised trainer (SFT, reward model, DPO) on one machine, in one or several processes.

    python launchers/local/train.py --trainer sft|reward_model|dpo [--procs N] [--launcher torchrun|mpiexec]
                                    [--gpus LIST] [--config NAME] [--config-path DIR] [KEY=VALUE ...]

--config defaults to the trainer's CPU demo (`<trainer>_demo`); KEY=VALUE overrides go to the trainer (e.g.
exp_dir=..., data.train_file=..., parallel.tensor_model_parallel_size=2). More than one process uses torchrun (gloo
on CPU, NCCL on GPU) or `mpiexec -n N` (--launcher mpiexec), as launchers/local/ppo.py does; --gpus 0,1 sets the
job's CUDA_VISIBLE_DEVICES. The job runs in the current directory (relative paths, exp_dir included, are
relative to it, then to the repository). The config is loaded and checked here first (a mistake is one line, exit
2, nothing started). SIGTERM / SIGINT reach the trainer, which checkpoints and exits 0; rerunning the same command
resumes. Exit status: the trainer's. The last line printed is `metrics: <exp_dir>/metrics.jsonl`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from ppo import command, gpu_env, job_env  # noqa: E402  (launchers/local/ppo.py: the same process commands)

TRAINERS = {  # trainer -> (script, config loader module)
    "sft": ("train_sft.py", "aligner.config.sft:load_sft_config"),
    "reward_model": ("train_reward_model.py", "aligner.config.reward_model:load_reward_model_config"),
    "dpo": ("train_dpo.py", "aligner.config.dpo:load_dpo_config"),
}


def load_config(trainer: str, config_args: list[str], overrides: list[str], procs: int):
    """The trainer's config as the trainer will load it (torch-free), checked for `procs` ranks; a mistake is
    SystemExit(2) with one line naming the key."""
    import importlib

    from aligner.config import ConfigError

    module, fn = TRAINERS[trainer][1].split(":")
    try:
        cfg = getattr(importlib.import_module(module), fn)(config_args + overrides)
        cfg.validate_world(procs)
    except ConfigError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainer", required=True, choices=sorted(TRAINERS))
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--launcher", choices=["torchrun", "mpiexec"], default="torchrun")
    p.add_argument("--gpus", default=None, metavar="LIST", help="GPU indices for the job, e.g. 0,1")
    p.add_argument("--config", default=None, help="config name (default: <trainer>_demo)")
    p.add_argument("--config-path", default=None, help="directory of the config (default: conf/)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.procs < 1:
        p.error("--procs must be >= 1")
    try:
        gpus = gpu_env(args.gpus, args.procs, "--gpus")
    except ValueError as exc:
        p.error(str(exc))
    config = args.config or f"{args.trainer}_demo"
    config_args = ["--config-name", config] + (["--config-path", args.config_path] if args.config_path else [])
    cfg = load_config(args.trainer, config_args, args.overrides, args.procs)

    script = TRAINERS[args.trainer][0]
    overrides = (["--config-path", args.config_path] if args.config_path else []) + args.overrides
    cmd = command(script, args.procs, config, overrides, args.launcher)
    print(f"[train] {' '.join(cmd)}", flush=True)
    env = {**job_env(), **gpus, "ALIGNER_NO_METRICS_LINE": "1"}
    # The caller's working directory: relative paths in the overrides (and exp_dir) mean what they meant here.
    job = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, frame):
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGTERM)  # every rank checkpoints at the same step and exits 0

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = job.wait()
    if code != 0:
        print(f"[train] the {args.trainer} job failed (status {code})", file=sys.stderr)
        return code if code > 0 else 1
    print(f"metrics: {os.path.join(os.path.abspath(cfg.exp_dir), 'metrics.jsonl')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
