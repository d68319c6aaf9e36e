"""Time forward+backward of the megatron-core GPT model aligner builds, per attention backend.

    python scripts/bench_model.py --preset 1b --attention unfused,sdpa --batch 8 --seq 2048 [--out bench.json]
    python scripts/bench_model.py --preset tiny   # CPU smoke run

Loss: mean next-token NLL through aligner's vocab-parallel log-probs (what PPO training computes). Prints a table.
FLOPs: 6*N*tokens (N = all parameters but the input embedding) plus attention: the two attention matmuls cost
4*B*T^2*d per layer forward, x3 for forward+backward, halved for the causal mask (6*L*B*T^2*d).
MFU = those FLOPs per second over `--peak-tflops` (bf16 matmul peak measured on the H200 here: ~790).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from aligner.config import ModelConfig  # noqa: E402
from aligner.models.gpt import build_gpt, forward  # noqa: E402
from aligner.models.logprobs import default_tp_group, shift_for_next_token, vocab_parallel_logprobs  # noqa: E402
from aligner.parallel import initialize, shutdown  # noqa: E402

PRESETS = {
    "1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=100,
        max_position_embeddings=256,
    ),
}


def flops_per_step(cfg: ModelConfig, n_params: int, batch: int, seq: int) -> tuple[float, float]:
    tokens = batch * seq
    dense = 6.0 * n_params * tokens
    attn = 12.0 * cfg.num_layers * batch * seq * seq * cfg.hidden_size / 2  # causal: half the score matrix
    return dense, attn


def bench(cfg: ModelConfig, batch: int, seq: int, warmup: int, iters: int) -> dict:
    model = build_gpt(cfg)
    device = next(model.parameters()).device
    n_params = sum(p.numel() for n, p in model.named_parameters() if "word_embeddings" not in n)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)

    def step():
        logits = forward(model, tokens)
        lg, tg = shift_for_next_token(logits, tokens)
        loss = -vocab_parallel_logprobs(lg, tg, default_tp_group(), vocab_size=cfg.vocab_size).mean()
        loss.backward()
        return loss

    for _ in range(warmup):
        step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - start) / iters
    dense, attn = flops_per_step(cfg, n_params, batch, seq)
    mem = torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else float("nan")
    return {
        "attention": cfg.attention_backend,
        "seconds": seconds,
        "tokens_per_s": batch * seq / seconds,
        "tflops_6nd": dense / seconds / 1e12,
        "tflops_total": (dense + attn) / seconds / 1e12,
        "params": n_params,
        "peak_mem_gb": mem,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--attention", default="unfused,sdpa")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="measured bf16 matmul peak (H200 here: ~790)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    batch = args.batch or (8 if args.preset == "1b" else 2)
    seq = args.seq or (2048 if args.preset == "1b" else 64)
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    initialize(seed=0)
    rows = []
    try:
        for backend in args.attention.split(","):
            cfg = ModelConfig(**PRESETS[args.preset], params_dtype=dtype, attention_backend=backend)
            row = bench(cfg, batch, seq, args.warmup, args.iters)
            row["mfu"] = row["tflops_total"] / args.peak_tflops if gpu else float("nan")
            rows.append(row)
            if gpu:
                torch.cuda.empty_cache()  # the model of this backend is gone with bench()'s frame
    finally:
        shutdown()
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"\nforward+backward, preset {args.preset}, batch {batch} x {seq} tokens, {dtype}, {device}")
    print(f"{'attention':<10}{'s/step':>10}{'tokens/s':>12}{'TFLOP/s 6ND':>13}{'TFLOP/s all':>13}{'MFU':>7}{'GB':>8}")
    for r in rows:
        print(
            f"{r['attention']:<10}{r['seconds']:>10.4f}{r['tokens_per_s']:>12.0f}{r['tflops_6nd']:>13.1f}"
            f"{r['tflops_total']:>13.1f}{r['mfu']:>7.1%}{r['peak_mem_gb']:>8.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "batch": batch,
                    "seq": seq,
                    "dtype": dtype,
                    "device": device,
                    "torch": torch.__version__,
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
