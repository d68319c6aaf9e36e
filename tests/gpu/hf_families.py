"""GPU check (run by hand on a GPU machine, not collected by pytest): a Hugging Face model of each supported family,
converted (scripts' convert_hf_to_dist) and loaded by our jobs' way (build_gpt + load_model_weights) on the GPU, runs
the forward HF's own model computes, there, in bf16. HF's model is the independent reference for what megatron runs
only on a GPU (its fused bias-dropout-add and SwiGLU, our compiled RoPE) and for the checkpoint's way onto the GPU.

Per family (tests/convert_models.py's random HF models at --hidden 512, 8 heads, 2 KV groups, 2 layers; reward
models too): our bf16 logits (or scores) against HF's float32 forward of the same bf16 weights, with HF's own bf16
forward as the yardstick. PASS: ours no farther from float32 than HF's bf16 forward times 1.5 in the mean |difference|
and 3 in the largest (one value: noisy), plus 1e-3 of the float32 output's largest value (for float32 runs, where
those are ~0). Prints one line per
family and a table; exit 1 on any FAIL.

    python3 tests/gpu/hf_families.py [--out report.json]
    python3 tests/gpu/hf_families.py --tiny        (CPU: the tiny float32 models of the conversion tests)

On a GPU image whose transformers imports scipy built for numpy 2: install megatron-core and omegaconf from
gpu-wheels.sh's wheels without their numpy 1.26 (PyTriton's pin), or transformers fails to import.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: convert_models
sys.path.insert(0, HERE)

from engine_families import finish  # noqa: E402

KINDS = (
    "llama", "mistral", "qwen2", "llama3", "qwen3", "phi3", "phi3_longrope", "phi4mini", "smollm3", "gpt2",
    "llama_reward", "qwen3_reward", "phi3_reward", "gpt2_reward",
)  # fmt: skip
LIMIT_TO_HF_BF16, MAX_TO_HF_BF16, SLACK = 1.5, 3.0, 1e-3  # see the module docstring


def sizes(kind: str, hidden: int) -> dict:
    """HF config fields for a model the GPU kernels take (head width 64; Qwen3's 128, not hidden / heads)."""
    from convert_models import longrope_parameters

    if kind.startswith("gpt2"):
        return {"n_embd": hidden, "n_head": hidden // 64, "n_positions": 128}
    out = {"hidden_size": hidden, "intermediate_size": 3 * hidden, "num_attention_heads": hidden // 64}
    out.update(num_key_value_heads=2, max_position_embeddings=128)  # 2 layers (the configs' per-layer lists)
    out["head_dim"] = 128 if kind.startswith("qwen3") else 64  # set at the config's creation: not derived again
    if kind == "phi3_longrope":  # 128 of 512 positions pre-trained (Phi-3.5: 4096 of 131072)
        out.update(max_position_embeddings=512, original_max_position_embeddings=128)
        out["rope_parameters"] = longrope_parameters(32, 128)
    if kind == "phi4mini":  # the same over 3/4 of each head: 48 of 64 channels, 24 frequencies
        out.update(max_position_embeddings=512, original_max_position_embeddings=128, partial_rotary_factor=0.75)
        out["rope_parameters"] = longrope_parameters(24, 128, 0.75)
    return out


def run_kind(kind: str, args, device, workdir: str) -> dict:
    from convert_models import CONVERT_CAP, hf_outputs, make_hf
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from aligner.checkpoint.convert import convert_hf_to_dist, load_model_yaml
    from aligner.checkpoint.dist_ckpt import load_model_weights
    from aligner.models.gpt import build_gpt, forward

    dtype = torch.float32 if args.tiny else torch.bfloat16
    hf_dir, conv = os.path.join(workdir, kind), os.path.join(workdir, f"{kind}_conv")
    # the conversion tests' weights (std 0.15 at hidden 64) scaled to the width, so that activations stay O(1) as in
    # trained models: at 0.15 and hidden 512 the residual stream reached ~40 and amplified every bf16 rounding
    std = 0.15 if args.tiny else 0.15 * (64 / args.hidden) ** 0.5
    overrides = None if args.tiny else sizes(kind, args.hidden)
    hf = make_hf(kind, hf_dir, seed=args.seed, dtype=dtype, overrides=overrides, std=std)
    cap = None if kind not in CONVERT_CAP else 128 if overrides else CONVERT_CAP[kind]  # (sizes' pre-training context)
    convert_hf_to_dist(hf_dir, conv, max_position_embeddings=cap)
    cfg = replace(load_model_yaml(os.path.join(conv, "model.yaml")), rope_fusion=args.rope_fusion)
    reward = kind.endswith("reward")
    ours = build_gpt(cfg, head="scalar" if reward else "lm")
    load_model_weights(conv, [ours])
    ours.eval()
    vocab = hf.config.vocab_size
    tokens = torch.randint(1, 90, (4, args.seq_len), generator=torch.Generator().manual_seed(3)).to(device)
    # HF's models loaded from the saved directory as a user loads them: make_hf's model.to(bf16) also rounded its RoPE
    # frequencies (a float buffer) to bf16, which from_pretrained keeps in float32 (that made the Llama model at RoPE
    # base 5000 look 1.4x farther from HF's float32 forward than HF's own bf16 forward: docs/PERF.md)
    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    del hf
    with torch.no_grad():
        got = forward(ours, tokens).float()
        got = got if reward else got[..., :vocab]
        hf_low = hf_outputs(cls.from_pretrained(hf_dir, dtype=dtype).to(device).eval(), tokens).float()
        ref = hf_outputs(cls.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval(), tokens).float()
    scale = float(ref.abs().max())
    row = {"kind": kind, "dtype": str(cfg.params_dtype), "rope_fused": bool(ours.config.apply_rope_fusion)}
    row["seed"] = args.seed
    for name, out in (("ours", got), ("hf_bf16", hf_low)):
        diff = (out - ref).abs()
        row[f"{name}_mean"], row[f"{name}_max"] = float(diff.mean()), float(diff.max())
    row["pass"] = (
        row["ours_mean"] <= LIMIT_TO_HF_BF16 * row["hf_bf16_mean"] + SLACK * scale
        and row["ours_max"] <= MAX_TO_HF_BF16 * row["hf_bf16_max"] + SLACK * scale
        and bool(torch.isfinite(got).all())
    )
    verdict = "PASS" if row["pass"] else "FAIL"
    print(
        f"{verdict} {kind}: vs HF float32 mean {row['ours_mean']:.4f} max {row['ours_max']:.3f} (HF's own "
        f"{cfg.params_dtype}: {row['hf_bf16_mean']:.4f} / {row['hf_bf16_max']:.3f}; outputs up to {scale:.1f})",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the conversion tests' tiny float32 models, on the CPU")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of the GPU models (default 512)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 96; tiny: 12)")
    parser.add_argument("--seed", type=int, default=0, help="the HF models' random weights")
    parser.add_argument("--rope-fusion", choices=("auto", "off"), default="auto", help="model.rope_fusion of ours")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.seq_len = args.seq_len or (12 if args.tiny else 96)

    from aligner.parallel import initialize

    initialize(1, 1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with tempfile.TemporaryDirectory() as workdir:
        rows = [run_kind(kind, args, device, workdir) for kind in args.kinds]
    print("\n| family | dtype | RoPE fused | ours vs HF float32: mean / max | HF's own: mean / max | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['kind']} | {r['dtype']} | {r['rope_fused']} | {r['ours_mean']:.4f} / {r['ours_max']:.3f} | "
            f"{r['hf_bf16_mean']:.4f} / {r['hf_bf16_max']:.3f} | {'PASS' if r['pass'] else 'FAIL'} |"
        )
    return finish(rows, args.out, device)


if __name__ == "__main__":
    sys.exit(main())
