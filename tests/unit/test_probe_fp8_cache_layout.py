"""benchmarks/probes/fp8_cache_layout.py on the CPU (Triton's interpreter, tests/conftest.py): the FP8 cache's values
as rows and in chunks of each size give the same attention, which is what makes the GPU timings comparable, and
the rows form matches float32 attention over the dequantized cache."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import fp8_cache_layout  # noqa: E402


def test_every_layout_attends_to_the_same_values(tmp_path):
    argv = ["--tiny", "--batch-sizes", "3", "--chunks", "8", "32", "--blocks", "16", "--out", str(tmp_path / "r.json")]
    row = fp8_cache_layout.main(argv)["batches"]["3"]
    assert set(row["us"]) == {"fp8_rows_b16", "fp8_chunk8_b16", "fp8_chunk32_b16"}
    assert all(d < 1e-6 for d in row["max_diff_to_rows"].values()), row["max_diff_to_rows"]
    assert row["rows_vs_float32"] < 1e-5
    assert (tmp_path / "r.json").exists()


def test_ragged_rows_attend_to_the_same_values():
    """--ragged: each row its own position (a generate call's spread); still every layout gives the rows' output,
    and so do the base-2 softmax (--exp2) and the warps' own slots (--warp-slots)."""
    argv = ["--tiny", "--ragged", "--batch-sizes", "3", "--chunks", "16", "--blocks", "32", "--warps", "2"]
    row = fp8_cache_layout.main([*argv, "--exp2", "0", "1", "--warp-slots", "0", "1"])["batches"]["3"]
    assert row["max_diff_to_rows"]["fp8_chunk16_b32_w2_s0"] < 1e-6 and row["rows_vs_float32"] < 1e-5
    # the softmax in base 2 (--exp2 1), each warp its own slots (--warp-slots 1): the same attention within float32
    # rounding (the tiny rows' 9 slots lie in the first warp's share: exact there)
    diff = row["max_diff_to_rows"]
    assert 0 < diff["fp8_chunk16_b32_w2_s0_exp2"] < 1e-5 and 0 < diff["fp8_chunk16_b32_w2_s0_exp2_own"] < 1e-5
    assert diff["fp8_chunk16_b32_w2_s0_own"] < 1e-6
