"""scripts/generate.py as a process, on tiny random HF models of every policy family built here and converted once per
family: greedy responses equal HF `generate(do_sample=False)` in float32 token for token (plain and chat prompts,
the stop token from generation_config.json included when generated), one output line per input line in order; bad
input exits 2 in one line and writes nothing.

The conversions run in this process (`convert_hf_to_dist`, what scripts/convert_hf_to_nemo.py calls; the script
itself runs in test_generate_parallel.py, test_walkthrough.py and test_convert_scripts.py): one interpreter start
per family saved, generate.py is the process under test."""

import json
import os
import subprocess
import sys

import pytest
from convert_models import CONVERT_CAP
from tiny_assets import CHAT, MAX_NEW, ROWS, hf_greedy, make_source, prompt_ids, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def run(script, *args, timeout=300):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", script), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """kind -> (directory with hf/ and ckpt/ (the converted model), HF model, HF tokenizer, stop)."""
    from aligner.checkpoint.convert import convert_hf_to_dist

    cache = {}

    def get(kind):
        if kind not in cache:
            root = tmp_path_factory.mktemp(kind)
            model, hf_tok, stop = make_source(kind, root / "hf")
            convert_hf_to_dist(str(root / "hf"), str(root / "ckpt"), max_position_embeddings=CONVERT_CAP.get(kind))
            cache[kind] = (root, model, hf_tok, stop)
        return cache[kind]

    return get


# llama3: Llama 3.2-style (llama3 RoPE scaling, tied embeddings); qwen3: per-head q/k norms, head_dim 24 != 64 / 4;
# phi3: fused qkv_proj and gate_up_proj; phi3_longrope: Phi-3.5's LongRoPE (short factors, attention factor);
# phi4mini: LongRoPE over 3/4 of each head; smollm3: the second layer without RoPE
KINDS = ["llama", "mistral", "qwen2", "gpt2", "llama3", "qwen3", "phi3", "phi3_longrope", "phi4mini", "smollm3"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generate_equals_hf_generate(tmp_path, converted, kind):
    root, model, hf_tok, stop = converted(kind)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "out.jsonl"
    args = ["--checkpoint", root / "ckpt", "--prompts", prompts, "--output", out, "--max-new-tokens", MAX_NEW]
    gen = run("generate.py", *args, "--greedy", "--batch-size", 3)  # two engine calls, prompts of mixed lengths
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip().endswith(f"wrote {out} (4 responses)")
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == len(ROWS)
    for row, line in zip(ROWS, lines):
        expected = hf_greedy(model, prompt_ids(hf_tok, row))
        assert line["response_token_ids"] == expected, (kind, row)
        assert line["response"] == hf_tok.decode(expected, skip_special_tokens=True)
    assert lines[0]["response_token_ids"][-1] == stop and len(lines[0]["response_token_ids"]) <= 3, "stop included"
    assert [line["prompt"] for line in lines] == [
        ROWS[0]["prompt"],
        ROWS[1]["prompt"],
        hf_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
        ROWS[3]["prompt"],
    ]
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl", "prompts.jsonl"], "no temporary file left"


def test_bad_input_exits_2_in_one_line_and_writes_nothing(tmp_path, converted):
    root = converted("llama")[0]
    # the converted model with a model.yaml that wants q/k/v biases its weights lack: strict loading names them
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    (mismatched / "model").symlink_to(root / "ckpt" / "model")
    (mismatched / "tokenizer").symlink_to(root / "ckpt" / "tokenizer")
    shape = (root / "ckpt" / "model.yaml").read_text()
    assert "add_qkv_bias: false" in shape
    (mismatched / "model.yaml").write_text(shape.replace("add_qkv_bias: false", "add_qkv_bias: true"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], {"prompt": 3}])
    out = tmp_path / "out.jsonl"
    common = ["--checkpoint", root / "ckpt", "--output", out, "--max-new-tokens", 4, "--prompts", bad]
    cases = [
        ([], f"{bad}:2: needs a string 'prompt'"),
        (["--temperature", "0"], "--temperature"),
        (["--max-new-tokens", 64], "leaves no room for a prompt"),  # the model has 64 positions
        (["--checkpoint", root / "hf"], "is not an aligner checkpoint"),
        (["--checkpoint", mismatched, "--prompts", write_jsonl(tmp_path / "ok.jsonl", ROWS)], "linear_qkv.bias"),
    ]
    for extra, message in cases:
        proc = run("generate.py", *common, *extra)
        assert proc.returncode == 2, (extra, proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1].startswith("generate: ") and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not out.exists()
