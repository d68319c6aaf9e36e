"""docs/WALKTHROUGH.md, run as written: its bash blocks in order (each after the first, which sets the paths), for a
tiny random Llama 3.2-style model (llama3 RoPE scaling, tied embeddings) built by the doc itself (the doc's Qwen3
variant, ARCH=qwen3, runs the same commands; Qwen3's own paths are held to HF by test_generate.py, test_convert_*.py
and test_families.py, so CI runs the walkthrough once): HF directory -> convert -> PPO with a reward function, both
jobs configured by `model.checkpoint` alone (2 steps, through launchers/local/ppo.py) -> generate.py on the actor's
checkpoint and export -> transformers loads and generates. Each stage's exit code and files are checked before the
next runs."""

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "WALKTHROUGH.md")
STAGES = ["setup", "tiny model", "convert", "prompts and reward", "ppo", "generate and export", "transformers"]
# model.yaml lines that only the family's own traits produce (the jobs' step checkpoints must carry them too)
TRAITS = {
    "llama3": ["arch: llama", "rope_scaling: llama3", "rope_scaling_factor: 32.0", "tie_embeddings: true"],
    "qwen3": ["arch: llama", "qk_layernorm: true", "head_dim: 32", "tie_embeddings: false"],
}


def blocks() -> list[str]:
    with open(DOC) as f:
        return re.findall(r"^```bash\n(.*?)^```", f.read(), re.S | re.M)


def test_the_doc_has_one_block_per_stage():
    assert len(blocks()) == len(STAGES), "a block was added to or removed from docs/WALKTHROUGH.md: update STAGES"


@pytest.mark.parametrize("arch", ["llama3"])
def test_walkthrough(tmp_path, arch):
    work, shim = tmp_path / "work", tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # the doc's `python`: this one
    (shim / "python").chmod(0o755)
    env = {
        **os.environ,
        "WORK": str(work),
        "ARCH": arch,
        "PATH": f"{shim}:{os.environ['PATH']}",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    setup, *steps = blocks()
    results = {}
    for stage, block in zip(STAGES[1:], steps):
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", setup + block],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, f"{stage}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        results[stage] = proc

        if stage == "tiny model":
            assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= set(
                os.listdir(work / "hf")
            )
        elif stage == "convert":
            assert (work / "ckpt" / "model.yaml").is_file() and (work / "ckpt" / "tokenizer").is_dir()
            shape = (work / "ckpt" / "model.yaml").read_text().splitlines()
            assert set(TRAITS[arch]) <= set(shape), shape
        elif stage == "prompts and reward":
            rows = [json.loads(line) for line in (work / "prompts.jsonl").read_text().splitlines()]
            assert len(rows) == 32 and sum("messages" in r for r in rows) == 16
        elif stage == "ppo":
            assert proc.stdout.strip().splitlines()[-1] == f"metrics: {work}/run/actor/metrics.jsonl"
            metrics = [json.loads(line) for line in (work / "run" / "actor" / "metrics.jsonl").read_text().splitlines()]
            assert [m["step"] for m in metrics] == [0, 1]
            assert all(
                math.isfinite(m["rollout/reward_mean"]) and math.isfinite(m["critic/value_loss"]) for m in metrics
            )
            assert metrics[0]["ppo/kl"] == 0 and metrics[1]["ppo/kl"] != 0, "the policy was updated after step 0"
            # model.checkpoint alone gave both jobs the converted model's shape and tokenizer
            for job in ("actor", "critic"):
                shape = (work / "run" / job / "checkpoints" / "step_000002" / "model.yaml").read_text().splitlines()
                assert set(TRAITS[arch]) <= set(shape) and f"tokenizer: {work}/ckpt/tokenizer" in shape, (job, shape)
            assert os.listdir(work / "run" / "critic" / "checkpoints") == ["step_000002"]
        elif stage == "generate and export":
            lines = [json.loads(line) for line in (work / "responses.jsonl").read_text().splitlines()]
            assert len(lines) == 32 and all({"prompt", "response", "response_token_ids"} <= set(line) for line in lines)
            assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
                os.listdir(work / "hf_trained")
            )
            exported = json.loads((work / "hf_trained" / "config.json").read_text())
            source = json.loads((work / "hf" / "config.json").read_text())
            assert exported["architectures"] == source["architectures"]
        elif stage == "transformers":
            assert re.search(r"^transformers: '.*'$", proc.stdout, re.M), proc.stdout
    assert list(results) == STAGES[1:]

    # the exported model is the trained policy: transformers' greedy answer equals generate.py's on the first prompt
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(work / "hf_trained", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(work / "hf_trained")
    first = json.loads((work / "responses.jsonl").read_text().splitlines()[0])
    ids = tok(first["prompt"])["input_ids"]  # row 0 is a plain prompt
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, pad_token_id=tok.pad_token_id)
    assert out[0, len(ids) :].tolist() == first["response_token_ids"]
