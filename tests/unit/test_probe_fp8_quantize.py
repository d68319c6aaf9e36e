"""benchmarks/probes/fp8_quantize.py on the CPU (Triton's interpreter, tests/conftest.py): the row quantization kernel
and the add+norm kernel's quantized row give fp8.quantize_rows's values over e4m3's whole range, the cases whose GPU
counts the probe reports."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import fp8_quantize  # noqa: E402


def test_the_kernel_gives_torchs_values_over_the_whole_range(tmp_path):
    report = fp8_quantize.main(["--tiny", "--out", str(tmp_path / "r.json")])
    cases = {"randn", "wide", "bf16 wide"}
    assert set(report["values"]) == cases | {f"add+norm {c}" for c in cases}  # the add+norm kernel's quantization too
    for row in report["values"].values():
        assert row["values"] > 0 and row["values_differing"] == 0 and row["scales_differing"] == 0, row
    assert report["requantize"] == {}  # GPU only
    assert (tmp_path / "r.json").exists()
