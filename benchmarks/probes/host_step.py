"""Probe (issue 17, thirty-ninth session): where the host spends an SFT micro-batch, for a sampling profiler.

At one packed 4096-token row a micro-batch the ~1B model's step took 75-93 ms of wall against 50-56 ms of kernels
(benchmarks/probes/packed_sft.py, docs/PERF.md thirty-ninth session): the host set the pace. This probe runs that
micro-batch (forward, the SFT loss, backward; no optimizer step) back to back for `--seconds`, without a sync
between steps, so that a sampling profiler sees the host's steady state:

    py-spy record --format raw --rate 250 -o stacks.txt -- python3 benchmarks/probes/host_step.py [--attention varlen]
        [--rope kernel|compiled]
    python3 benchmarks/probes/host_step.py --summarise stacks.txt      (top functions, self and inclusive)

`--summarise` keeps the samples under `step_body` and drops those inside torch.compile's compiler, Triton's or the
import system (the first steps' compilation), then prints each function's share of what is left.

    python3 benchmarks/probes/host_step.py --tiny --seconds 1       (CPU: the probe itself)
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

COMPILING = (
    "convert_frame.py",
    "compile_fx",
    "codecache",
    "triton/backends",
    "async_compile",
    "autotune",
    "importlib",
    "sympy",
    "guards.py",
)  # frames of the first steps' compilation, not of the steady state
FRAME = re.compile(r"(.*?) \((.*?)(?::\d+)?\)$")


def run(args) -> dict:
    from aligner.config import ModelConfig
    from aligner.models.attention import Segments
    from aligner.models.gpt import build_gpt
    from aligner.models.logprobs import default_tp_group, vocab_parallel_logprobs
    from aligner.parallel import initialize
    from benchmarks.model import PRESETS
    from benchmarks.probes.packed_sft import packed

    gpu = torch.cuda.is_available() and not args.tiny
    width, sample = (64, 16) if args.tiny else (args.width, args.sample)
    initialize(seed=1)
    shape = PRESETS["tiny" if args.tiny else "1b"]
    cfg = ModelConfig(
        **{**shape, "max_position_embeddings": width},
        params_dtype="bfloat16" if gpu else "float32",
        attention_backend="sdpa",
    )
    model = build_gpt(cfg)
    device = next(model.parameters()).device
    mb = packed(width, sample, cfg.vocab_size, device)
    tokens, targets = mb["tokens"], mb["targets"]
    varlen = args.attention == "varlen"

    def step_body():
        how = (
            {"attention_mask": None, "packed_seq_params": Segments.of(mb["segment_ids"], device)}
            if varlen
            else {"attention_mask": mb["attention_mask"]}
        )
        logits = model(tokens, mb["position_ids"], **how)
        logp = vocab_parallel_logprobs(logits[:, :-1], tokens[:, 1:], default_tp_group(), vocab_size=cfg.vocab_size)
        (-logp[targets[:, 1:]].mean()).backward()

    for _ in range(5):
        step_body()
    if gpu:
        torch.cuda.synchronize()
    start, steps = time.perf_counter(), 0
    while time.perf_counter() - start < args.seconds:
        step_body()
        steps += 1
    if gpu:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / steps * 1e3
    print(f"{args.attention}, RoPE {args.rope}: {ms:.1f} ms a step over {steps} steps (no sync between steps)")
    return {"attention": args.attention, "rope": args.rope, "ms_per_step": ms, "steps": steps}


def summarise(path: str, top: int = 25) -> dict:
    """Shares of py-spy's raw samples (`frame;frame;... count` lines) under `step_body`, compilation left out."""

    def name(frame: str) -> str:
        m = FRAME.match(frame)
        return f"{m.group(1)} [{m.group(2).split('site-packages/')[-1]}]" if m else frame

    own, under, total = collections.Counter(), collections.Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any("step_body" in fr for fr in frames) or any(c in fr for fr in frames for c in COMPILING):
                continue
            total += int(count)
            own[name(frames[-1])] += int(count)
            for key in {name(fr) for fr in frames}:
                under[key] += int(count)
    report = {"samples": total, "self": own.most_common(top), "inclusive": under.most_common(top * 2)}
    print(f"{total} samples of the steady state")
    for title, rows in (("self", report["self"]), ("inclusive", report["inclusive"])):
        print(f"\n| {title} share | function |\n|---|---|")
        for key, n in rows:
            print(f"| {n / max(total, 1):.1%} | {key[:150]} |")
    return report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--attention", choices=["varlen", "mask"], default="varlen")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--sample", type=int, default=1024, help="tokens a sample")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rope", choices=["kernel", "compiled"], default="kernel", help="model.rope_fusion's form on a GPU")
    p.add_argument("--summarise", metavar="STACKS", default=None, help="py-spy's raw output to summarise")
    args = p.parse_args(argv)
    if args.summarise:
        return summarise(args.summarise)
    from aligner.models import rope_fusion

    kernel_takes = rope_fusion._kernel_takes
    if args.rope == "compiled":  # the torch.compile form the Triton kernel replaced (forty-first session)
        rope_fusion._kernel_takes = lambda t, freqs: False
    try:
        return run(args)
    finally:
        rope_fusion._kernel_takes = kernel_takes


if __name__ == "__main__":
    main()
