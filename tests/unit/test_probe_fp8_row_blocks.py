"""benchmarks/probes/fp8_row_blocks.py on the CPU (Triton's interpreter, tests/conftest.py): every Triton tiling it
times, the engine's included, computes the same products as float32 maths of the same e4m3 values, in several blocks
of rows; that is what makes its GPU timings comparable with cuBLAS's."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import fp8_row_blocks  # noqa: E402


def test_every_tiling_computes_the_product(tmp_path):
    report = fp8_row_blocks.main(["--tiny", "--out", str(tmp_path / "r.json")])
    timed = [name for name, us in report["us"].items() if us is not None]
    assert len(timed) == len(report["us"]), "a tiling failed"
    errors = report["err"]
    assert {name.split()[0] for name in errors} == {"fc1", "qkv", "fc2", "out", "proj"}
    assert any("(engine)" in name for name in errors)
    assert all(e < 1e-5 for e in errors.values()), errors
    assert (tmp_path / "r.json").exists()


def test_shapes_of_each_preset():
    """qkv's rows are the queries' and both KV groups' columns (the 1B's 4096 as the twenty-sixth session timed it)."""
    assert fp8_row_blocks.shapes("1b") == (16, 2048, 8192, 4096, 32000)
    assert fp8_row_blocks.shapes("8b") == (32, 4096, 14336, 4096 + 2 * 8 * 128, 32000)
