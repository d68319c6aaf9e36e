"""benchmarks/probes/packed_sft.py on the CPU (tiny model, float32): the masked and the varlen packed row compute the
same loss (the unpacked row another), and every path is timed."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import packed_sft  # noqa: E402


def test_masked_and_varlen_rows_give_one_loss(tmp_path):
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    report = packed_sft.main(["--tiny", "--repeats", "1", "--out", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists() and report["device"] == "cpu"
    (table,) = report["tables"]
    causal, mask, varlen = table["model"]
    assert [r["path"] for r in table["attention"]][1:] == [r["path"] for r in table["model"]][1:] == ["mask", "varlen"]
    assert abs(mask["loss"] - varlen["loss"]) < 1e-5
    assert abs(causal["loss"] - mask["loss"]) > 1e-3  # attention across samples changes the loss
    assert all(r["ms"] > 0 for r in table["attention"] + table["model"])
