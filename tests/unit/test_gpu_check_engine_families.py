"""tests/gpu/engine_families.py (the engine on each model family, run by hand on a GPU) run on the CPU at its tiny
sizes: its comparison passes where the engine is right and fails where a refit is lost."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "engine_families.py")


@pytest.fixture(scope="module")
def script():
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    spec = importlib.util.spec_from_file_location("engine_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_family_passes_on_the_cpu(script, tmp_path):
    out = tmp_path / "report.json"
    assert script.main(["--tiny", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["family"] for r in rows} == set(script.FAMILIES) and len(rows) == 3 * len(script.FAMILIES)
    assert all(r["pass"] and r["mismatch_max"] < 1e-4 for r in rows)
    assert all(r["refit_changed_tokens"] for r in rows if r["what"] == "greedy after refit")


def test_a_lost_refit_fails(script, monkeypatch, tmp_path):
    from aligner.generation.native.engine import NativeEngine

    monkeypatch.setattr(NativeEngine, "refit", lambda self, policy: None)
    out = tmp_path / "report.json"
    assert script.main(["--tiny", "--families", "llama3.2-style", "--share-weights", "off", "--out", str(out)]) == 1
    rows = {r["what"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["greedy"]["pass"] and rows["sampled"]["pass"]
    assert not rows["greedy after refit"]["pass"] and rows["greedy after refit"]["mismatch_mean"] > 0.02
