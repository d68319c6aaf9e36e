"""Forward+backward time of the megatron-core GPT model aligner builds, per attention backend.

`run(...)` builds the model once per backend (in an initialised `aligner.parallel` world; the caller initialises
and shuts down) and returns one row per backend; `format_table` renders them. scripts/bench_model.py is the entry.
Loss: mean next-token NLL through aligner's vocab-parallel log-probs (what PPO training computes).
FLOPs: 6*N*tokens (N = all parameters but the input embedding) plus attention: the two attention matmuls cost
4*B*T^2*d per layer forward, x3 for forward+backward, halved for the causal mask (6*L*B*T^2*d).
MFU = those FLOPs per second over `peak_tflops` (bf16 matmul peak measured on the H200 here: ~790).
"""

from __future__ import annotations

import time

import torch

from aligner.config import ModelConfig
from aligner.models.gpt import build_gpt, forward
from aligner.models.logprobs import default_tp_group, shift_for_next_token, vocab_parallel_logprobs
from aligner.parallel.device import on_gpu
from aligner.parallel.device import synchronize as sync
from benchmarks.profiling import profile_call
from benchmarks.shapes import PRESETS


def flops_per_step(cfg: ModelConfig, n_params: int, batch: int, seq: int) -> tuple[float, float]:
    tokens = batch * seq
    dense = 6.0 * n_params * tokens
    attn = 12.0 * cfg.num_layers * batch * seq * seq * cfg.hidden_size / 2  # causal: half the score matrix
    return dense, attn


def bench(cfg: ModelConfig, batch: int, seq: int, warmup: int, iters: int, profile: bool = False) -> dict:
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
    if on_gpu():
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    seconds = (time.perf_counter() - start) / iters
    dense, attn = flops_per_step(cfg, n_params, batch, seq)
    mem = torch.cuda.max_memory_allocated() / 1e9 if on_gpu() else float("nan")
    extra = {"profile": profile_call(step, device)} if profile else {}
    return {
        **extra,
        "attention": cfg.attention_backend,
        "recompute": cfg.recompute,
        "seconds": seconds,
        "tokens_per_s": batch * seq / seconds,
        "tflops_6nd": dense / seconds / 1e12,
        "tflops_total": (dense + attn) / seconds / 1e12,
        "params": n_params,
        "peak_mem_gb": mem,
    }


def run(
    preset: str,
    backends: list[str],
    batch: int,
    seq: int,
    dtype: str,
    warmup: int,
    iters: int,
    peak_tflops: float,
    recompute: tuple[str, ...] = ("none",),
    profile: bool = False,
    rope_fusion: tuple[str, ...] = ("auto",),
    logprob_fusion: tuple[str, ...] = ("auto",),
) -> list[dict]:
    """One `bench` row per attention backend and activation recomputation (`model.recompute`), with its MFU (NaN on
    CPU). Recomputed work is not counted in the FLOPs: the row's MFU is what the model's own work gets. With `profile`,
    each row also holds a top-kernels table of one more step (benchmarks.profiling)."""
    gpu = on_gpu()
    rows = []
    for backend in backends:
        for mode, fusion, lp_fusion in ((m, f, g) for m in recompute for f in rope_fusion for g in logprob_fusion):
            cfg = ModelConfig(
                **PRESETS[preset],
                params_dtype=dtype,
                attention_backend=backend,
                recompute=mode,
                rope_fusion=fusion,
                logprob_fusion=lp_fusion,
            )
            row = bench(cfg, batch, seq, warmup, iters, profile)
            row["rope_fusion"], row["logprob_fusion"] = fusion, lp_fusion
            row["mfu"] = row["tflops_total"] / peak_tflops if gpu else float("nan")
            rows.append(row)
            if gpu:
                torch.cuda.empty_cache()  # the model of this row is gone with bench()'s frame
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'attention':<10}{'recompute':<10}{'rope fusion':<12}{'logp fusion':<12}{'s/step':>10}{'tokens/s':>12}"
        f"{'TFLOP/s 6ND':>13}{'TFLOP/s all':>13}{'MFU':>7}{'GB':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['attention']:<10}{r.get('recompute', 'none'):<10}{r.get('rope_fusion', 'off'):<12}"
            f"{r.get('logprob_fusion', 'off'):<12}"
            f"{r['seconds']:>10.4f}{r['tokens_per_s']:>12.0f}{r['tflops_6nd']:>13.1f}"
            f"{r['tflops_total']:>13.1f}{r['mfu']:>7.1%}{r['peak_mem_gb']:>8.1f}"
        )
    return "\n".join(lines)
