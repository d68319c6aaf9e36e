"""The actor job stops on a bad prompt file with one line naming the file and line, exit 2 (scripts/train_ppo_actor.py
catches DataError on every rank)."""

import os
import subprocess
import sys

from tiny_assets import write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def test_a_chat_row_without_a_chat_template_stops_the_actor_in_one_line(tmp_path):
    rows = [{"prompt": "say a: cat:"}, {"messages": [{"role": "user", "content": "say a"}]}]
    path = write_jsonl(tmp_path / "prompts.jsonl", rows)
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "train_ppo_actor.py"),
            "--config-name",
            "ppo_actor_demo",
            f"data.train_file={path}",
            f"exp_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train_ppo_actor: {path}:2: a chat row ('messages') but the tokenizer has no chat template")
    assert "Traceback" not in proc.stderr
