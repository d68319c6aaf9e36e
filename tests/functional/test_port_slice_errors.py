"""A bad ALIGNER_PORT_SLICE (aligner/utils/net.py) is a user's setting: the local launcher and the jobs that draw a
port name it in one line and exit 2, before starting anything."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")


@pytest.mark.parametrize(
    "argv",
    [
        ["launchers/local/ppo.py"],
        ["scripts/train_ppo_actor.py", "--config-name", "grpo_demo"],
        ["scripts/serve_ppo_critic.py", "--config-name", "ppo_critic_demo"],
        ["scripts/train_sft.py", "--config-name", "sft_demo"],
    ],
    ids=lambda argv: os.path.basename(argv[0]),
)
def test_a_bad_port_slice_is_one_line_and_exit_2(tmp_path, argv):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}  # one process: it draws its own port
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", ALIGNER_PORT_SLICE="2/2")
    where = ["--exp-dir", str(tmp_path)] if argv[0].startswith("launchers") else [f"exp_dir={tmp_path}"]
    proc = subprocess.run(
        [sys.executable, *argv, *where], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "ALIGNER_PORT_SLICE='2/2': write k/n" in proc.stderr.strip().splitlines()[-1]
    assert os.listdir(tmp_path) == []  # nothing started, nothing written
