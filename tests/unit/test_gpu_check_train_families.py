"""tests/gpu/train_families.py (the training forward and backward of each model family with the GPU's fusions, run
by hand on a GPU) run on the CPU at its tiny sizes: it passes where the fused model is right and fails where the
fused RoPE computes something else."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "train_families.py")


@pytest.fixture(scope="module")
def script():
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    spec = importlib.util.spec_from_file_location("train_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_family_passes_on_the_cpu(script, tmp_path):
    out = tmp_path / "report.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["family"] for r in rows} == set(script.FAMILIES)
    assert all(r["pass"] and r["fused"]["grads"] > 10 and r["fused"]["grad_max"] < 1e-4 for r in rows)


def test_a_wrong_fused_rope_fails(script, monkeypatch, tmp_path):
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    from aligner.models import rope_fusion

    monkeypatch.setattr(rope_fusion, "rope_bshd", lambda t, freqs: t)  # no rotation at all
    monkeypatch.setattr(rope_fusion, "_compiled", None)
    out = tmp_path / "report.json"
    assert script.main(["--tiny", "--fusion", "on", "--families", "qwen3-style", "--out", str(out)]) == 1
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rope_fused"] and not row["pass"] and row["fused"]["logp_mean"] > 0.01
