"""scripts/bench_trainers.py on the CPU demo model (the command that makes the trainers' GPU lines in docs/PERF.md):
it writes its synthetic workload, runs the real entry script and summarises the trainer's own metrics."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_trainers_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "scripts", "bench_trainers.py"),
        "--trainer",
        "dpo",
        "--config",
        "dpo_demo",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--rows",
        "32",
        "--prompt-tokens",
        "6",
        "--response-tokens",
        "10",
        "--exp-dir",
        str(tmp_path / "exp"),
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("| dpo | 1 | ")
    result = json.loads(out.read_text())
    assert result["steps_timed"] == 2 and result["tokens_per_s"] > 0 and result["params"] > 0
    # 32 pairs per step (the demo's global batch); a sequence: BOS, 6 prompt words, 10 response words, EOS
    assert result["tokens_per_step"] == 32 * 2 * (1 + 6 + 10 + 1)


def test_the_parameter_count_takes_a_gated_mlp_from_the_family():
    from aligner.config.schema import ModelConfig
    from benchmarks.trainers import _model_params

    sizes = dict(hidden_size=8, num_layers=2, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=12)
    # a layer: q and o 8x8 each, k and v 8x(2 groups x width 2) each, then the MLP; embeddings 10x8, untied: twice
    gated = 2 * (64 + 64 + 64 + 3 * 8 * 12) + 2 * 80
    for arch in ("llama", "phi3"):
        assert _model_params(ModelConfig(arch=arch, vocab_size=10, tie_embeddings=False, **sizes)) == gated
    plain = 2 * (64 + 64 + 64 + 2 * 8 * 12) + 2 * 80
    assert _model_params(ModelConfig(arch="gpt2", vocab_size=10, tie_embeddings=False, **sizes)) == plain
