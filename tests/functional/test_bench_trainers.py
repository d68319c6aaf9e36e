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
