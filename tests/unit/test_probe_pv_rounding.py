"""benchmarks/probes/pv_rounding.py: the FP8 cache's probabilities rounded to float16 add an error far below the
e4m3 cache's own (the finding of docs/PERF.md, thirty-seventh session, that closed the x256 lead)."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import pv_rounding  # noqa: E402


def test_the_kernels_loop_replayed_without_rounding_is_plain_attention():
    g = torch.Generator().manual_seed(0)
    scores, values = torch.randn(4, 70, generator=g, dtype=torch.float64), torch.randn(4, 70, 8, dtype=torch.float64)
    out = pv_rounding.attend(scores, values, torch.ones(4, 70, dtype=torch.float64), 16, None)
    torch.testing.assert_close(out, torch.einsum("nt,ntd->nd", scores.softmax(-1), values), rtol=1e-12, atol=1e-12)


def test_float16_probabilities_cost_far_less_than_the_e4m3_cache(tmp_path):
    report = pv_rounding.main(["--tiny", "--out", str(tmp_path / "r.json")])
    assert len(report["rows"]) == 9 and (tmp_path / "r.json").exists()
    for row in report["rows"]:
        assert 0 < row["rounding_x1_mean"] < row["e4m3_mean"] / 20, row
        assert 0 < row["rounding_x256_mean"] <= row["rounding_x1_mean"] * 1.01, row
    small = [row for row in report["rows"] if row["value_std"] < 0.1]
    # where products fall below float16's normal range, the factor of 256 keeps bits
    assert all(row["rounding_x256_mean"] < row["rounding_x1_mean"] * 0.9 for row in small)
