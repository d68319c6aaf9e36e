"""benchmarks/probes/host_step.py on the CPU: the step loop runs both attention forms, and the summary of a
sampling profiler's raw stacks keeps the steady state under `step_body` only."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import host_step  # noqa: E402


@pytest.mark.parametrize("attention", ["varlen", "mask"])
def test_the_step_loop_runs(attention):
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    report = host_step.main(["--tiny", "--seconds", "0.3", "--attention", attention])
    assert report["attention"] == attention and report["steps"] >= 1 and report["ms_per_step"] > 0


def test_the_summary_keeps_the_steady_state_under_step_body(tmp_path):
    stacks = tmp_path / "stacks.txt"
    stacks.write_text(
        "<module> (p.py:1);step_body (p.py:9);forward (m.py:3);matmul (l.py:7) 6\n"
        "<module> (p.py:1);step_body (p.py:9);forward (m.py:3) 2\n"
        "<module> (p.py:1);step_body (p.py:9);segment_starts (packing.py:100) 2\n"
        "<module> (p.py:1);step_body (p.py:9);compile_wrapper (torch/_dynamo/convert_frame.py:5) 50\n"
        "<module> (p.py:1);build (p.py:4) 40\n"
    )
    report = host_step.summarise(str(stacks))
    assert report["samples"] == 10
    assert dict(report["self"]) == {"matmul [l.py]": 6, "forward [m.py]": 2, "segment_starts [packing.py]": 2}
    inclusive = dict(report["inclusive"])
    assert inclusive["step_body [p.py]"] == 10 and inclusive["forward [m.py]"] == 8
