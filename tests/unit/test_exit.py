"""aligner/utils/exit.py: a job script's process ends with main's code, its atexit handlers and flushed output, and
with everything alive moved out of the collector's view (what makes the exit quick)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_SCRIPTS = [
    "train_ppo_actor.py",
    "serve_ppo_critic.py",
    "train_sft.py",
    "train_reward_model.py",
    "train_dpo.py",
    "generate.py",
    "convert_hf_to_nemo.py",
    "convert_nemo_to_hf.py",
    "bench_ppo_step.py",
    "bench_generation.py",
]

PROGRAM = """
import atexit, gc, sys
from aligner.utils.exit import exit_after_main
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0, flush=True))
kept = [[i] for i in range(1000)]
sys.stdout.write("unflushed line\\n")
exit_after_main(3)
"""


def test_exit_keeps_the_code_the_handlers_and_the_output_and_freezes_what_is_alive():
    proc = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["unflushed line", "frozen at exit: True"]


def test_the_job_scripts_end_through_it():
    for name in JOB_SCRIPTS:
        with open(os.path.join(ROOT, "scripts", name)) as f:
            tail = f.read().rsplit('if __name__ == "__main__":', 1)[1]
        assert "exit_after_main(main(" in tail, f"scripts/{name} ends with a plain sys.exit"
