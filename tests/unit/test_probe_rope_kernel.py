"""benchmarks/probes/rope_kernel.py on the CPU (the kernel under Triton's interpreter): every form runs forward and
backward, and each lands near the exact rotation."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import rope_kernel  # noqa: E402


def test_the_probe_runs_every_form_near_the_exact_rotation(tmp_path):
    out = tmp_path / "rope.json"
    report = rope_kernel.main(["--tiny", "--out", str(out)])
    rows = {r["form"]: r for r in report["rows"]}
    assert set(rows) == {"kernel", "compiled", "megatron unfused"} and out.exists()
    for r in rows.values():  # bf16 inputs of spread 1: a few of bf16's roundings (the interpreter truncates)
        assert r["us_a_call"] > 0 and 0 < r["out_err_max"] < 0.06 and 0 < r["grad_err_max"] < 0.06, r
    assert 0 < report["kernel_equals_compiled"]["outputs"] <= 1


def test_the_exact_rotation_is_the_rotation():
    import torch

    t = torch.tensor([[[[1.0, 0.0, 0.0, 2.0]]]])  # one position, one head: pairs (1, 0) and (0, 2)
    freqs = torch.tensor([[[[torch.pi / 2, 0.0, torch.pi / 2, 0.0]]]])
    out, grad = rope_kernel.exact(t, freqs, torch.ones_like(t))
    # (x1, x2) by angle a: (x1 cos a - x2 sin a, x2 cos a + x1 sin a): pair 0 turns a quarter, pair 1 stays
    torch.testing.assert_close(out, torch.tensor([[[[0.0, 0.0, 1.0, 2.0]]]], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([[[[1.0, 1.0, -1.0, 1.0]]]], dtype=torch.float64))
