"""scripts/generate.py on 2 ranks through torchrun (gloo): TP=2 and PP=2 greedy responses equal HF `generate`
token for token; two data-parallel ranks sample exactly what one process samples (prompt i draws with seed + i,
whatever the layout and batch), and the output keeps the input's order."""

import json
import os
import subprocess
import sys

from dist import free_port
from tiny_assets import MAX_NEW, ROWS, hf_greedy, make_source, prompt_ids, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def generate(procs: int, *args):
    head = [sys.executable]
    if procs > 1:
        head += ["-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port", str(free_port())]
    cmd = head + [os.path.join(ROOT, "scripts", "generate.py"), *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_tp2_pp2_and_dp2_generation(tmp_path):
    model, hf_tok, _ = make_source("llama", tmp_path / "hf")
    conv = subprocess.run(
        [sys.executable, "scripts/convert_hf_to_nemo.py", "--input", tmp_path / "hf", "--output", tmp_path / "ckpt"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stderr[-3000:]
    rows = ROWS + [{"prompt": f"w{i} w{i + 1}"} for i in range(50, 55)]  # 9 prompts: uneven over 2 DP ranks
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    common = ["--checkpoint", tmp_path / "ckpt", "--prompts", prompts, "--max-new-tokens", MAX_NEW]

    expected = [hf_greedy(model, prompt_ids(hf_tok, row)) for row in rows]
    for layout in (["--tp", 2], ["--pp", 2]):
        out = tmp_path / f"greedy{layout[0]}.jsonl"
        proc = generate(2, *common, "--output", out, "--greedy", *layout)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert [line["response_token_ids"] for line in read(out)] == expected, layout

    sampling = ["--temperature", "0.9", "--top-k", "40", "--seed", "11"]
    one = generate(1, *common, "--output", tmp_path / "one.jsonl", *sampling, "--batch-size", 4)
    two = generate(2, *common, "--output", tmp_path / "two.jsonl", *sampling, "--batch-size", 2)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    sampled = [line["response_token_ids"] for line in read(tmp_path / "one.jsonl")]
    assert [line["response_token_ids"] for line in read(tmp_path / "two.jsonl")] == sampled
    assert sampled != expected, "sampling at temperature 0.9 is not greedy decoding"
    assert [line["prompt"] for line in read(tmp_path / "two.jsonl")][-1] == rows[-1]["prompt"]
