"""A checkpoint written by the actor job converts back to HF (scripts/convert_nemo_to_hf.py, no extra arguments:
the checkpoint carries model.yaml), and HF's logits equal ours on the same tokens."""

import os
import subprocess
import sys

import torch
from dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _our_logits(rank, world, ckpt, tokens):
    from aligner.checkpoint import dist_ckpt
    from aligner.checkpoint.convert import load_model_yaml
    from aligner.models.gpt import build_gpt, forward
    from aligner.parallel import initialize

    initialize(seed=0)
    cfg = load_model_yaml(os.path.join(ckpt, "model.yaml"))
    model = build_gpt(cfg)
    dist_ckpt.load_model_weights(ckpt, [model])
    model.eval()
    with torch.no_grad():
        return forward(model, tokens)[..., : cfg.vocab_size]


def test_trained_actor_checkpoint_exports_to_hf(tmp_path):
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "launchers", "local", "ppo.py"),
            "--exp-dir",
            str(tmp_path),
            "--actor",
            "ppo.num_steps=2",
            "validation.every=0",
            "logging.progress_bar=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    ckpt = tmp_path / "actor" / "checkpoints" / "step_000002"
    out = tmp_path / "hf"
    conv = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "convert_nemo_to_hf.py"),
            "--input",
            str(ckpt),
            "--output",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert conv.returncode == 0, conv.stderr[-3000:]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    tokens = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = hf(tokens).logits
    ours = run_ranks(_our_logits, 1, str(ckpt), tokens)[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    # the policy moved during those two steps, so this is a trained model, not the initial one
    import json

    with open(tmp_path / "actor" / "metrics.jsonl") as f:
        assert [json.loads(line)["ppo/kl"] > 0 for line in f] == [False, True]
