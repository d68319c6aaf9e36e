"""benchmarks/probes/attention_candidates.py on the CPU (--tiny: Triton's interpreter for the kernel stage, the
engine's CPU settings for the engine stage): every candidate attends as float32 attention does, the engine runs with
its own settings, with the plain candidate's (the settings before the thirty-first session) and with the fastest
candidates' constants set (each in a process of its own)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import pytest  # noqa: E402

pytest.importorskip("triton")

from benchmarks.probes import attention_candidates  # noqa: E402


def test_settings_name_the_engine_constants():
    assert attention_candidates.settings(attention_candidates.CANDIDATES["own_exp2_cap168"]) == [
        "triton_decode.FP8_BLOCK_N=128", "triton_decode.FP8_WARPS=4", "triton_decode.FP8_STAGES=2",
        "triton_decode.FP8_MAXNREG=168", "triton_decode.EXP2=True", "triton_decode.FP8_WARP_SLOTS=True",
        "triton_decode.FP8_R_PAD=16",
    ]  # fmt: skip
    # every constant set: the plain candidate holds at every batch size (no cap: 0), not the engine's by-size choice
    plain = attention_candidates.settings(attention_candidates.CANDIDATES["plain"])
    assert "triton_decode.FP8_MAXNREG=0" in plain and "triton_decode.FP8_WARPS=4" in plain


def test_candidates_timed_alone_and_in_the_engine(tmp_path):
    names = ["plain", "own_exp2_cap168", "w2_b64_exp2_cap128", "w1_b32_exp2_q4"]
    argv = ["--tiny", "--batch-sizes", "3", "--repeats", "1", "--top", "1", "--candidates", *names]
    report = attention_candidates.main([*argv, "--out", str(tmp_path / "r.json")])
    assert (tmp_path / "r.json").exists()
    for name in names:
        row = report["kernel"][name]["3"]
        assert row["us"] > 0 and row["vs_float32"] < 1e-5, (name, row)
    # the engine's own settings, the plain candidate's and the one faster other candidate (by the kernel's time
    # alone), every call reported
    faster = min(names[1:], key=lambda n: report["kernel"][n]["3"]["us"])
    assert set(report["engine"]) == {"engine", "plain", faster}
    for run in report["engine"].values():
        assert len(run["3"]["decode_ms"]) == 1 and run["args"]["batch_sizes"] == [3]
    assert report["engine"][faster]["args"]["set"] == attention_candidates.settings(
        attention_candidates.CANDIDATES[faster]
    )
    assert report["engine"]["engine"]["args"]["set"] == []


def test_grpo_shaped_calls_prefilled_once_and_every_row(tmp_path):
    """--groups: the engine on calls of groups of neighbouring rows sharing a prompt, in each of GROUP_FORMS (on the
    CPU the Triton settings are not read; the prefill counts are)."""
    argv = ["--tiny", "--batch-sizes", "3", "--repeats", "1", "--top", "0", "--candidates", "plain"]
    report = attention_candidates.main([*argv, "--groups", "2", "--group-batch", "4"])
    assert set(report["groups"]) == set(attention_candidates.GROUP_FORMS)
    prefilled = {name: run["4"]["prefill_prompts"] for name, run in report["groups"].items()}
    assert prefilled == {"each_row": 4, "once": 2, "once_shared": 2, "once_groups": 2, "once_plain": 2}
    assert report["groups"]["once"]["args"]["set"] == ["triton_decode.SHARED_PREFIX=False"]
    assert report["groups"]["once_shared"]["args"]["set"] == ["triton_decode.GROUP_PREFIX=False"]
    assert report["groups"]["once_groups"]["args"]["set"] == [
        "triton_decode.GROUP_PREFIX=True", "triton_decode.GROUP_PREFIX_MIN_BATCH=2"
    ]  # fmt: skip
    assert report["groups"]["once_plain"]["args"]["set"] == attention_candidates.settings(
        attention_candidates.CANDIDATES["plain"]
    )
