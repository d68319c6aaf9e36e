"""Probe (issue 17, thirty-ninth session): where an SFT micro-batch's time goes, one packed row at a time.

On an H100 (docs/PERF.md, thirty-ninth session) `scripts/bench_trainers.py --trainer sft` ran packed rows of 4 samples
of 1,024 tokens no faster through the samples' starts (flash varlen) than through the dense block-diagonal mask
(3.49 s a step against 3.34), while rows of 16 samples of 256 tokens ran 1.22x faster. This probe times the pieces:

- `attention`: one layer's attention alone (the 1B shape: 16 query heads, 8 KV heads, head width 128), forward and
  backward, over one row of `--width` tokens: SDPA causal (one sample: the floor), SDPA with the block-diagonal mask
  (the `mask` path: KV heads repeated, the memory-efficient kernel), the flash varlen kernel (the `varlen` path);
- `model`: the whole 1B model's forward and backward with the SFT loss (mean next-token NLL over the targets,
  aligner's vocab-parallel log-probs) on one row: unpacked causal, mask, varlen; milliseconds as the median of
  `--repeats` after 3, and with `--profile` a top-kernels table of one more (benchmarks.profiling). The loss of
  each is reported: mask and varlen compute the same one (within bf16 rounding), the unpacked row another.

Rows hold samples of `--sample` tokens each (several values: one table each); attention FLOPs are counted as computed
(the mask computes the whole square; causal and varlen half of each sample's).

    python3 benchmarks/probes/packed_sft.py [--width 4096] [--sample 1024 256] [--profile] [--out FILE]
    python3 benchmarks/probes/packed_sft.py --tiny     (CPU: the probe itself, the varlen path as SDPA per sample)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.probes.common import write_report  # noqa: E402


def timed_ms(fn, repeats: int, gpu: bool) -> float:
    times = []
    for i in range(repeats + 3):
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if gpu:
            torch.cuda.synchronize()
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def packed(width: int, sample: int, vocab: int, device) -> dict:
    """One row of `width` tokens: samples of `sample` tokens (the last one cut to fit), every token a target but
    each sample's first."""
    from aligner.data.packing import collate, packed_row
    from aligner.data.supervised import Sample

    rng = np.random.default_rng(0)
    samples, room = [], width
    while room >= 2:
        n = min(sample, room)
        samples.append(Sample(rng.integers(4, vocab, n), np.arange(n) >= 1))
        room -= n
    return collate([packed_row(samples)], width, pad_id=0, device=device, mask=True)


def attention_rows(width: int, sample: int, heads: int, groups: int, dim: int, repeats: int, gpu: bool) -> list:
    from aligner.models.attention import segment_attention

    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    q = torch.randn(width, heads, dim, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(width, groups, dim, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    grad = torch.randn(width, heads, dim, device=device, dtype=dtype)
    starts = torch.arange(0, width + sample, sample, dtype=torch.int32, device=device).clamp_max(width).unique()
    segment = torch.repeat_interleave(torch.arange(len(starts) - 1, device=device), starts.diff())
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(width, width, dtype=torch.bool, device=device).tril()
    scale = dim**-0.5

    def bhsd(x):
        return x.transpose(0, 1).unsqueeze(0)

    def causal():
        out = F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, scale=scale, enable_gqa=True)
        out.backward(bhsd(grad))

    def masked():  # as SDPAttention.forward with a mask: KV heads repeated, a bool mask
        r = heads // groups
        kk, vv = (bhsd(x).repeat_interleave(r, dim=1) for x in (k, v))
        F.scaled_dot_product_attention(bhsd(q), kk, vv, attn_mask=allowed, scale=scale).backward(bhsd(grad))

    def varlen():
        segment_attention(q, k, v, starts, sample, scale).backward(grad)

    one_sample = 4.0 * width * width * heads * dim / 2  # causal forward: half the square
    samples_flops = 4.0 * sum(int(n) ** 2 for n in starts.diff()) * heads * dim / 2
    rows = []
    for name, fn, flops in (
        ("causal (one sample)", causal, one_sample),
        ("mask", masked, 4.0 * width * width * heads * dim),
        ("varlen", varlen, samples_flops),
    ):
        ms = timed_ms(fn, repeats, gpu)
        rows.append({"path": name, "ms": ms, "tflops": 3.5 * flops / ms / 1e9})  # backward ~2.5x forward
    return rows


def model_rows(cfg, width: int, sample: int, repeats: int, gpu: bool, profile: bool) -> list:
    from aligner.models.attention import Segments
    from aligner.models.gpt import build_gpt
    from aligner.models.logprobs import default_tp_group, vocab_parallel_logprobs
    from benchmarks.profiling import profile_call

    model = build_gpt(cfg)
    device = next(model.parameters()).device
    mb = packed(width, sample, cfg.vocab_size, device)
    tokens, targets = mb["tokens"], mb["targets"]
    plain_positions = torch.arange(width, device=device)[None]

    def step(**how):
        logits = model(tokens, how.pop("position_ids", mb["position_ids"]), **how)
        logp = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], default_tp_group(), vocab_size=cfg.vocab_size)
        loss = -logp[targets[:, 1:]].mean()
        loss.backward()
        model.zero_grad(set_to_none=False)
        return loss.detach()

    paths = (
        ("causal (unpacked)", lambda: step(position_ids=plain_positions, attention_mask=None)),
        ("mask", lambda: step(attention_mask=mb["attention_mask"])),
        ("varlen", lambda: step(attention_mask=None, packed_seq_params=Segments.of(mb["segment_ids"], device))),
    )
    rows = []
    for name, fn in paths:
        row = {"path": name, "loss": float(fn()), "ms": timed_ms(fn, repeats, gpu)}
        if profile:
            row["profile"] = profile_call(fn, device, top=8)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--sample", type=int, nargs="+", default=[1024, 256], help="tokens a sample")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from aligner.config import ModelConfig
    from aligner.parallel import initialize
    from benchmarks.model import PRESETS
    from benchmarks.profiling import format_profile

    gpu = torch.cuda.is_available() and not args.tiny
    width = 64 if args.tiny else args.width
    samples = [16] if args.tiny else args.sample
    shape = PRESETS["tiny" if args.tiny else "1b"]
    initialize(seed=5)
    cfg = ModelConfig(
        **{**shape, "max_position_embeddings": width},
        params_dtype="bfloat16" if gpu else "float32",
        attention_backend="sdpa",
    )
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    dim = cfg.hidden_size // heads
    report = {"width": width, "device": torch.cuda.get_device_name() if gpu else "cpu", "tables": []}
    for sample in samples:
        table = {
            "sample": sample,
            "attention": attention_rows(width, sample, heads, groups, dim, args.repeats, gpu),
            "model": model_rows(cfg, width, sample, args.repeats, gpu, args.profile),
        }
        report["tables"].append(table)
        print(f"\nrow of {width} tokens, samples of {sample}: one layer's attention (fwd+bwd) | whole model step")
        print("| path | attention ms | attention TFLOP/s | model ms | loss |")
        print("|---|---|---|---|---|")
        for a, m in zip(table["attention"], table["model"], strict=True):
            print(f"| {m['path']} | {a['ms']:.3f} | {a['tflops']:.0f} | {m['ms']:.2f} | {m['loss']:.4f} |")
        for m in table["model"]:
            if "profile" in m:
                print(format_profile(m["profile"], f"{m['path']}, samples of {sample}"))
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
