import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "plot_metrics.py")


def test_plots_one_png_per_group(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(
            json.dumps({"step": s, "rollout/reward_mean": s / 10, "ppo/kl": 0.01 * s, "timing/step": 1.0}) + "\n"
            for s in range(5)
        )
    )
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(path), "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for group in ("rollout", "ppo", "timing"):
        png = tmp_path / "p" / f"{group}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_line_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "ppo/kl": 0}\n{oops\n')
    proc = subprocess.run([sys.executable, SCRIPT, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "metrics.jsonl:2" in proc.stderr
