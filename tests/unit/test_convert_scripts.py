"""The two converter scripts as processes: one-process and torchrun (TP=2) conversion, export, exit codes."""

import json
import os
import subprocess
import sys

import torch
from convert_models import hf_tensors, make_hf
from dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_scripts_round_trip_one_process_and_torchrun(tmp_path):
    hf_dir = str(tmp_path / "hf")
    make_hf("qwen2", hf_dir)
    single = _run(
        "scripts/convert_hf_to_nemo.py", "--input", hf_dir, "--output", str(tmp_path / "one"), "--tp", "2", "--pp", "2"
    )
    assert single.returncode == 0, single.stderr[-3000:]
    info = json.load(open(tmp_path / "one" / "conversion.json"))
    assert info["converted_with_layout"] == [1, 1] and info["tensor_model_parallel_size"] == 2
    launched = _run(
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "scripts/convert_hf_to_nemo.py",
        "--input",
        hf_dir,
        "--output",
        str(tmp_path / "tp2"),
        "--tp",
        "2",
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert launched.stdout.count("wrote ") == 1  # rank 0 reports
    assert json.load(open(tmp_path / "tp2" / "conversion.json"))["converted_with_layout"] == [2, 1]
    back = _run("scripts/convert_nemo_to_hf.py", "--input", str(tmp_path / "tp2"), "--output", str(tmp_path / "back"))
    assert back.returncode == 0, back.stderr[-3000:]
    original, exported = hf_tensors(hf_dir), hf_tensors(str(tmp_path / "back"))
    assert sorted(original) == sorted(exported) and all(torch.equal(exported[k], v) for k, v in original.items())


def test_scripts_report_user_errors_in_one_line(tmp_path):
    hf_dir = str(tmp_path / "hf")
    make_hf("llama", hf_dir)
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    json.dump(dict(cfg, architectures=["FalconForCausalLM"]), open(os.path.join(hf_dir, "config.json"), "w"))
    bad = _run("scripts/convert_hf_to_nemo.py", "--input", hf_dir, "--output", str(tmp_path / "out"))
    assert bad.returncode == 2 and "error: architecture 'FalconForCausalLM'" in bad.stderr
    assert "Traceback" not in bad.stderr and not os.path.exists(tmp_path / "out")
    missing = _run("scripts/convert_nemo_to_hf.py", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o"))
    assert missing.returncode == 2 and "not an aligner checkpoint" in missing.stderr


def test_scripts_refuse_to_overwrite_their_input_and_name_damaged_files(tmp_path):
    """--overwrite never deletes the source; a truncated weights file or checkpoint shard is named (issue 14)."""
    hf_dir = tmp_path / "hf"
    make_hf("llama", str(hf_dir))
    for out in (hf_dir, hf_dir / "inside"):
        same = _run("scripts/convert_hf_to_nemo.py", "--input", str(hf_dir), "--output", str(out), "--overwrite")
        assert same.returncode == 2 and "would delete the source" in same.stderr, same.stderr[-2000:]
        assert (hf_dir / "config.json").exists()
    conv = tmp_path / "conv"
    assert _run("scripts/convert_hf_to_nemo.py", "--input", str(hf_dir), "--output", str(conv)).returncode == 0
    back = _run("scripts/convert_nemo_to_hf.py", "--input", str(conv), "--output", str(conv), "--overwrite")
    assert back.returncode == 2 and "would delete the source" in back.stderr and (conv / "model.yaml").exists()

    shard = max((p for p in (conv / "model").iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    cut = _run("scripts/convert_nemo_to_hf.py", "--input", str(conv), "--output", str(tmp_path / "x"))
    assert cut.returncode == 2 and shard.name in cut.stderr and "Traceback" not in cut.stderr, cut.stderr[-2000:]

    weights = next(hf_dir.glob("*.safetensors"))
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    bad = _run("scripts/convert_hf_to_nemo.py", "--input", str(hf_dir), "--output", str(tmp_path / "y"))
    assert bad.returncode == 2 and weights.name in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
