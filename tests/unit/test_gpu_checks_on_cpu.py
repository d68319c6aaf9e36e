"""The by-hand GPU checks of each model family (tests/gpu/engine_families.py: the generation engine;
tests/gpu/train_families.py: the training forward and backward; tests/gpu/hf_families.py: a converted HF model
against HF's forward; tests/gpu/packed_attention.py: packed rows by the samples' starts against the dense mask) run on
the CPU at their tiny sizes: they pass where the code is right and fail where a refit is lost, the fused RoPE computes
something else, a loaded weight is off or attention crosses the packed samples."""

import importlib.util
import json
import os

import pytest

GPU_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu")


@pytest.fixture(scope="module")
def scripts():
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    loaded = {}
    for name in ("engine_families", "train_families", "hf_families", "packed_attention"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(GPU_DIR, f"{name}.py"))
        loaded[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded[name])
    return loaded


def _rows(path):
    return json.loads(path.read_text())["rows"]


def test_the_engine_check_passes_for_every_family(scripts, tmp_path):
    script, out = scripts["engine_families"], tmp_path / "report.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = _rows(out)
    assert {r["family"] for r in rows} == set(script.FAMILIES) and len(rows) == 3 * len(script.FAMILIES)
    assert all(r["pass"] and r["mismatch_max"] < 1e-4 for r in rows)
    assert all(r["refit_changed_tokens"] for r in rows if r["what"] == "greedy after refit")


def test_the_engine_check_fails_a_lost_refit(scripts, monkeypatch, tmp_path):
    from aligner.generation.native.engine import NativeEngine

    monkeypatch.setattr(NativeEngine, "refit", lambda self, policy: None)
    out = tmp_path / "report.json"
    argv = ["--tiny", "--families", "llama3.2-style", "--share-weights", "off", "--out", str(out)]
    assert scripts["engine_families"].main(argv) == 1
    rows = {r["what"]: r for r in _rows(out)}
    assert rows["greedy"]["pass"] and rows["sampled"]["pass"]
    assert not rows["greedy after refit"]["pass"] and rows["greedy after refit"]["mismatch_mean"] > 0.02


def test_the_training_check_passes_for_every_family(scripts, tmp_path):
    script, out = scripts["train_families"], tmp_path / "report.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = _rows(out)
    assert {r["family"] for r in rows} == set(script.FAMILIES)
    assert all(r["pass"] and r["fused"]["grads"] > 10 and r["fused"]["grad_max"] < 1e-4 for r in rows)


def test_the_training_check_fails_a_wrong_fused_rope(scripts, monkeypatch, tmp_path):
    from aligner.models import rope_fusion

    monkeypatch.setattr(rope_fusion, "rope_kernel", lambda t, freqs: t)  # no rotation at all (the GPU's path)
    out = tmp_path / "report.json"
    argv = ["--tiny", "--fusion", "on", "--families", "qwen3-style", "--out", str(out)]
    assert scripts["train_families"].main(argv) == 1
    (row,) = _rows(out)
    assert row["rope_fused"] and not row["pass"] and row["fused"]["logp_mean"] > 0.01


def test_the_hf_check_passes_for_every_family(scripts, tmp_path):
    script, out = scripts["hf_families"], tmp_path / "report.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [r["kind"] for r in rows] == list(script.KINDS) and all(r["pass"] and r["ours_max"] < 1e-4 for r in rows)


def test_the_hf_check_fails_a_weight_loaded_wrong(scripts, monkeypatch, tmp_path):
    import torch

    from aligner.checkpoint import dist_ckpt

    real = dist_ckpt.load_model_weights

    def off(path, models, vocab_size=None):  # the final norm's weights 10 % off after loading
        real(path, models, vocab_size)
        with torch.no_grad():
            models[0].decoder.final_layernorm.weight.mul_(1.1)

    monkeypatch.setattr(dist_ckpt, "load_model_weights", off)
    out = tmp_path / "report.json"
    assert scripts["hf_families"].main(["--tiny", "--kinds", "llama3", "--out", str(out)]) == 1
    (row,) = _rows(out)
    assert not row["pass"] and row["ours_max"] > 0.01


def test_the_packed_attention_check_passes(scripts, tmp_path):
    out = tmp_path / "report.json"
    assert scripts["packed_attention"].main(["--tiny", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["pass"] and report["samples"] > 4 and report["varlen"]["grad_max"] < 1e-4


def test_the_packed_attention_check_fails_attention_across_samples(scripts, monkeypatch, tmp_path):
    import torch

    from aligner.data import packing

    def rows_only(segment_ids_BT):  # each row one segment: its samples see each other
        B, T = segment_ids_BT.shape
        return torch.arange(0, B * T + 1, T, dtype=torch.int32), T

    monkeypatch.setattr(packing, "segment_starts", rows_only)
    out = tmp_path / "report.json"
    assert scripts["packed_attention"].main(["--tiny", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert not report["pass"] and report["varlen"]["logp_mean"] > 0.01
