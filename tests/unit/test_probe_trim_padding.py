"""benchmarks/probes/trim_padding.py on the CPU (tiny model, float32): micro-batches cut to their longest row compute
less padding and the same log-probs as whole-width ones."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import trim_padding  # noqa: E402


def test_cut_micro_batches_compute_less_padding_and_the_same_logprobs(tmp_path):
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    report = trim_padding.main(["--tiny", "--max-tokens", "48", "--out", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists() and report["device"] == "cpu"
    whole, cut, by_tokens = report["rows"]
    assert (by_tokens["trim"], by_tokens["max_tokens"], cut["max_tokens"]) == (4, 48, None)
    assert by_tokens["micro_batches"] != cut["micro_batches"] and by_tokens["logprob_diff_max"] < 1e-4
    assert (whole["trim"], cut["trim"]) == (0, 4)
    assert len(whole["widths"]) == 1 and len(cut["widths"]) > 1 and max(cut["widths"]) == whole["widths"][0]
    assert cut["padding"] < whole["padding"] / 2
    assert whole["logprob_diff_max"] == 0 and cut["logprob_diff_max"] < 1e-4
    assert all(r["forward_s"] > 0 and r["step_s"] > 0 for r in report["rows"])


def test_counting_needs_no_model():
    report = trim_padding.main(["--count-only", "--rollouts", "64", "--trims", "0", "64", "1", "--max-tokens", "4096"])
    whole, cut, exact, by_tokens = report["rows"]
    assert whole["positions"] > cut["positions"] > exact["positions"]
    assert exact["padding"] < cut["padding"] < whole["padding"]
    assert whole["micro_batches"] == cut["micro_batches"] == 4 and whole["largest"] > 4096  # 16 rows, ~1,150 tokens
    assert (by_tokens["trim"], by_tokens["max_tokens"]) == (1, 4096)
    assert by_tokens["largest"] <= 4096 and by_tokens["micro_batches"] > 4  # more, smaller micro-batches
