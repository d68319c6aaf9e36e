"""benchmarks/probes/generate_repeats.py on the CPU with bench_generation's tiny model: every call's figures kept."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import generate_repeats  # noqa: E402


def test_every_call_is_reported(tmp_path):
    from dist import free_port

    from aligner.parallel import initialize

    initialize(
        1, 1, master_port=free_port()
    )  # the probe's own call then finds the group (a free port, not the default)
    out = tmp_path / "r.json"
    report = generate_repeats.main(["--tiny", "--repeats", "2", "--batch-sizes", "2", "3", "--out", str(out)])
    assert out.exists() and report["device"] == "cpu"
    # what the engine chose (here the CPU's: the Triton kernels need a GPU or the interpreter's explicit setting)
    assert report["engine"] == {"decode_attention": "matmul", "decode_gemm": "cublas", "token_choice": "torch"}
    for B in ("2", "3"):
        assert report[B].pop("prefill_prompts") == int(B)
        assert {k: len(v) for k, v in report[B].items()} == {"tok_s": 2, "prefill_ms": 2, "decode_ms": 2}
        assert all(v > 0 for values in report[B].values() for v in values)
    # GRPO-like groups: each prompt in 2 neighbouring rows, prefilled once (or, for the A/B, every row)
    for extra, prefilled in (([], 2), (["--prefill-each-row"], 4)):
        args = ["--tiny", "--repeats", "1", "--batch-sizes", "4", "--samples-per-prompt", "2", *extra]
        assert generate_repeats.main(args)["4"]["prefill_prompts"] == prefilled


def test_set_changes_a_constant_of_the_engine_modules(monkeypatch):
    """--set MODULE.NAME=VALUE (the engine probes' A/B of a setting in one tree): applied as a Python literal to a
    name the module has; anything else is one line naming the item."""
    import pytest

    from aligner.generation.native import triton_decode
    from benchmarks.probes.common import apply_settings, engine_parser

    monkeypatch.setattr(triton_decode, "FP8_MAXNREG", triton_decode.FP8_MAXNREG)  # restored afterwards
    monkeypatch.setattr(triton_decode, "EXP2", triton_decode.EXP2)
    args = engine_parser("probe", 1).parse_args(["--set", "triton_decode.FP8_MAXNREG=128", "triton_decode.EXP2=True"])
    assert apply_settings(args.set) == {"triton_decode.FP8_MAXNREG=128": 128, "triton_decode.EXP2=True": True}
    assert triton_decode.FP8_MAXNREG == 128 and triton_decode.EXP2 is True
    for item, message in (
        ("triton_decode.NO_SUCH=1", "has no NO_SUCH"),
        ("triton_decode.EXP2=yes", "is not a Python literal"),
        ("EXP2=1", "write MODULE.NAME=VALUE"),
    ):
        with pytest.raises(SystemExit, match=message):
            apply_settings([item])


def test_settings_for_every_process_of_a_job(tmp_path):
    """benchmarks/probes/every_process: ALIGNER_PROBE_SET applied by every Python process started with that folder on
    PYTHONPATH (a child of the child too), said on stderr; nothing without it; a malformed item ends the process."""
    import subprocess

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.join(root, "benchmarks", "probes", "every_process"), root]),
    }
    read = "from aligner.generation.native import triton_decode as t; print(t.SHARED_PREFIX)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {read!r}], check=True)"

    def run(setting):
        e = {**env, "ALIGNER_PROBE_SET": setting} if setting is not None else env
        return subprocess.run([sys.executable, "-c", child], env=e, capture_output=True, text=True, cwd=tmp_path)

    on = run("triton_decode.SHARED_PREFIX=False")
    assert on.returncode == 0 and on.stdout.strip() == "False", on.stderr
    assert on.stderr.count("[probe settings] triton_decode.SHARED_PREFIX=False") == 2, on.stderr  # parent and child
    off = run(None)
    assert off.returncode == 0 and off.stdout.strip() == "True" and "[probe settings]" not in off.stderr
    bad = run("triton_decode.NO_SUCH=1")
    assert bad.returncode != 0 and "has no NO_SUCH" in bad.stderr
