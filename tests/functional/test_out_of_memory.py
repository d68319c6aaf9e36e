"""A job that runs out of GPU memory (aligner.train.cli.run_job): its traceback, then one line that says so and names
the job's settings that take less, exit 1. The jobs are real (config, communicators, lock, models); only the
out-of-memory error is raised by hand where the training loop would have run, as no GPU is here to run out."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 GiB of which 41.00 MiB is "
    "free. Including non-PyTorch memory, this process has 78.9 GiB memory in use."
)
PROGRAM = """
import runpy, sys, torch
module, cls, script = sys.argv[1:4]
def fit(self):
    raise torch.OutOfMemoryError({oom!r})
setattr(getattr(__import__(module, fromlist=[cls]), cls), "fit", fit)
sys.argv = [script, *sys.argv[4:]]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.parametrize(
    "loop, script, config, hint",
    [
        ("aligner.train.loop:SupervisedLoop", "scripts/train_sft.py", "sft_demo", "lower train.micro_batch_size"),
        ("aligner.ppo.trainer:PPOTrainer", "scripts/train_ppo_actor.py", "grpo_demo", "lower ppo.micro_batch_size"),
    ],
    ids=["sft", "actor"],
)
def test_out_of_gpu_memory_is_the_traceback_then_one_line_naming_the_settings(tmp_path, loop, script, config, hint):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    module, cls = loop.split(":")
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM.format(oom=OOM), module, cls, script, "--config-name", config,
         f"exp_dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    name = os.path.basename(script)[: -len(".py")]
    assert last.startswith(
        f"{name}: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "79.18 GiB of which 41.00 MiB is free); "
    ), last
    assert hint in last and "Traceback" in proc.stderr and "OutOfMemoryError" in proc.stderr
