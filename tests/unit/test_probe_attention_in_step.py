"""benchmarks/probes/attention_in_step.py on the CPU (Triton's interpreter, tests/conftest.py): each way of calling the
decode attention, the engine's with the step's own key and value and RoPE included, gives the same output, which is
what makes its GPU timings comparable."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import attention_in_step  # noqa: E402


def test_every_variant_attends_to_the_same_values(tmp_path):
    report = attention_in_step.main(["--tiny", "--batch-sizes", "3", "--out", str(tmp_path / "r.json")])
    row = report["batches"]["3"]
    assert set(row["max_diff"]) == {
        "separate", "one_cache", "strided_q", "engine", "engine_no_pdl", "engine_block64",
    }  # fmt: skip
    assert all(d < 1e-5 for d in row["max_diff"].values()), row["max_diff"]
    assert all(t > 0 for t in row["us"].values()) and row["floor_us"] > 0
    assert (tmp_path / "r.json").exists()


def test_the_settings_sweep_attends_to_the_same_values():
    argv = ["--tiny", "--batch-sizes", "2", "--sweep", "--blocks", "8", "16", "--warps", "4", "--stages", "2", "3"]
    row = attention_in_step.main(argv)["batches"]["2"]
    swept = {name for name in row["max_diff"] if "," in name}
    assert swept == {"8,4,2", "8,4,3", "16,4,2", "16,4,3"}
    assert all(row["max_diff"][name] < 1e-5 for name in swept), row["max_diff"]
