"""benchmarks/probes/fp8_reference.py on the CPU with bench_generation's tiny model (the torch FP8 path): the engine's
log-probs equal megatron's forward with the engine's rounding put in, and that rounding is what separates them from
the plain forward."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import fp8_reference  # noqa: E402


def test_the_rounded_forward_is_the_engines(tmp_path):
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())  # the probe's own call then finds the group (a free port)
    out = tmp_path / "r.json"
    report = fp8_reference.main(["--tiny", "--batch-sizes", "3", "--rows", "3", "--out", str(out)])
    assert out.exists() and report["device"] == "cpu" and report["fp8_qkv"] is False  # the torch path: no qkv copies
    row = report["3"]
    assert row["rounded"]["logp_abs_diff_max"] < 1e-4, row
    assert row["plain"]["logp_abs_diff_mean"] > 100 * max(row["rounded"]["logp_abs_diff_mean"], 1e-7), row
    # the rounded forward moves megatron's log-probs by what separates the engine from the plain forward
    assert abs(row["rounding"]["logp_abs_diff_mean"] - row["plain"]["logp_abs_diff_mean"]) < 1e-4, row
    # without FP8 weights nothing is rounded: the plain and the rounded forward are one
    same = fp8_reference.main(["--tiny", "--batch-sizes", "3", "--rows", "3", "--decode-weights", "same"])["3"]
    assert same["rounding"]["logp_abs_diff_max"] == 0.0 and same["plain"] == same["rounded"]
