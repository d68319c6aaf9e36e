"""aligner.parallel.watchdog: a phase that hangs ends the process with one line naming where, never silently."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import sys, time
from aligner.parallel.watchdog import PhaseWatchdog
dog = PhaseWatchdog(float(sys.argv[1]), lambda: "rank 3, step 7:", poll_s=0.1)
with dog.phase("step"):
    for _ in range(5):                      # inner phases that each end in time: nothing fires,
        with dog.phase("generate"):         # although the step as a whole outlasts the limit
            time.sleep(0.3)
    with dog.phase("logprobs"):
        time.sleep(float(sys.argv[2]))
print("finished", flush=True)
"""


def _run(timeout_s, hang_s):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(timeout_s), str(hang_s)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_phase_that_hangs_ends_the_process_naming_rank_step_and_phase():
    proc = _run(1.0, 30)  # without the watchdog: "finished" after 30 s, exit 0
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "rank 3, step 7: phase 'step/logprobs' has run for more than 1 s" in proc.stderr
    assert "Stacks" in proc.stderr and "finished" not in proc.stdout


def test_phases_that_end_in_time_are_left_alone():
    proc = _run(1.0, 0.1)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr[-2000:]
