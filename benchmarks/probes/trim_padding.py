"""The actor's log-prob pass and policy update with micro-batches of the step's width against micro-batches sorted by
length and cut to their longest row (`ppo.trim_padding`), on rollouts of mixed lengths.

A TrainableModel of the ~1B benchmark shape (bf16; `--tiny`: 2 layers, hidden 64, float32 on the CPU) and one
synthetic rollout: `--rollouts` rows of `--prompt` prompt tokens and responses of a length drawn uniformly from
[--min-response, --max-response] (seeded), laid out by aligner.ppo.rollout.assemble at the longest row's width. Per
`--trims` value (0 = whole width): the micro-batches (aligner.ppo.rollout.micro_batches, `--micro-batch` rows) and
their padding share, the forward-only log-prob pass (what the reference and the old-policy pass run) and one
optimizer step over them (a masked mean log-prob loss, as the policy loss reads the same tensors), seconds as the
median of `--repeats` after one warm-up; and each trim's log-probs against the whole width's on the response tokens
(max |difference|; the GEMMs' shapes differ, so bf16 sums may round differently). `--max-tokens N`: one more row,
the last trim with micro-batches by tokens (`ppo.micro_batch_tokens`: as many rows as fit in N tokens).

    python3 benchmarks/probes/trim_padding.py [--rollouts 512] [--trims 0 64] [--max-tokens 16384] [--out FILE]
    python3 benchmarks/probes/trim_padding.py --tiny        (CPU: the probe itself; trims 0 and 4)
    python3 benchmarks/probes/trim_padding.py --count-only [--max-tokens N]  (no model: micro-batches, positions,
        padding share and the largest micro-batch of each setting)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.probes.common import write_report  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--rollouts", type=int, default=512)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--min-response", type=int, default=32)
    p.add_argument("--max-response", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--trims", type=int, nargs="+", default=[0, 64])
    p.add_argument("--max-tokens", type=int, default=None, help="also the last trim by tokens (ppo.micro_batch_tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--count-only", action="store_true", help="no model: the positions each trim computes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.rollouts, args.prompt, args.min_response, args.max_response = 16, 4, 1, 24
        args.micro_batch, args.repeats = 4, 1
        args.trims = [0, 4] if args.trims == [0, 64] else args.trims
    return args


def rollout_of(args, vocab: int, device):
    from aligner.ppo.rollout import assemble

    g = torch.Generator().manual_seed(0)
    B, P = args.rollouts, args.prompt
    responses = torch.randint(args.min_response, args.max_response + 1, (B,), generator=g)
    width = P + int(responses.max())
    return assemble(
        torch.randint(3, vocab, (B, P), generator=g).to(device),
        torch.full((B,), P, device=device),
        torch.randint(3, vocab, (B, int(responses.max())), generator=g).to(device),
        responses.to(device),
        torch.zeros(B, int(responses.max()), device=device),
        torch.ones(B, dtype=torch.bool, device=device),
        pad_id=0,
        total_length=width,
    )


def settings(args) -> list[tuple[int, int | None]]:
    """(trim, max_tokens) per row: each of --trims by rows, then the last by tokens with --max-tokens."""
    return [(trim, None) for trim in args.trims] + ([(args.trims[-1], args.max_tokens)] if args.max_tokens else [])


def name_of(row: dict) -> str:
    return f"{row['trim']}, {row['max_tokens']} tokens" if row["max_tokens"] else str(row["trim"])


def counts(args) -> dict:
    """Per trim: the positions its micro-batches compute and their padding share (the rollout only, no model)."""
    from aligner.ppo.rollout import micro_batches

    rollout = rollout_of(args, 32000, torch.device("cpu"))
    rows = []
    for trim, max_tokens in settings(args):
        micro = micro_batches(rollout, None, args.micro_batch, trim, max_tokens)
        computed = sum(mb["tokens"].numel() for mb in micro)
        padding = 1.0 - float(rollout.lengths_B.sum()) / computed
        largest = max(mb["tokens"].numel() for mb in micro)
        rows.append(
            {
                "trim": trim,
                "max_tokens": max_tokens,
                "micro_batches": len(micro),
                "positions": computed,
                "padding": padding,
                "largest": largest,
            }
        )
    print(f"{args.rollouts} rollouts of {args.prompt} + U({args.min_response}, {args.max_response}) tokens")
    print("| trim | micro-batches | positions | padding | largest micro-batch (positions) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {name_of(r)} | {r['micro_batches']} | {r['positions']:,} | {r['padding']:.3f} | {r['largest']:,} |")
    return write_report({"device": "none", "args": vars(args), "rows": rows}, args.out)


def main(argv=None) -> dict:
    args = parse(argv)
    if args.count_only:
        return counts(args)
    from aligner.config import ModelConfig, OptimConfig
    from aligner.models.logprobs import vocab_parallel_logprobs
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize, on_gpu, synchronize
    from aligner.ppo.rollout import by_row, micro_batches
    from benchmarks.model import PRESETS

    initialize(seed=0)
    gpu = on_gpu() and not args.tiny
    shape = PRESETS["tiny" if args.tiny else "1b"]
    cfg = ModelConfig(**shape, params_dtype="bfloat16" if gpu else "float32")
    model = TrainableModel(cfg, OptimConfig(lr=1e-7), head="lm")
    rollout = rollout_of(args, cfg.vocab_size, torch.device("cuda") if gpu else torch.device("cpu"))
    B, S = rollout.mask_BS.shape
    tokens = float(rollout.mask_BS.sum())

    def logprobs(batch, logits_BTV):
        return vocab_parallel_logprobs(logits_BTV[:, :-1], batch["tokens"][:, 1:], None, vocab_size=cfg.vocab_size)

    def loss(batch, logits_BTV):
        logp = logprobs(batch, logits_BTV)
        total = (logp * batch["mask"]).sum()
        return -total / tokens, {"tokens": batch["mask"].sum().double(), "logp_sum": total.detach().double()}

    def seconds(fn) -> float:
        times = []
        for i in range(args.repeats + 1):
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            if i:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    rows, reference = [], None
    for trim, max_tokens in settings(
        args
    ):  # every forward before any optimizer step: the log-probs compare like with like
        micro = micro_batches(rollout, None, args.micro_batch, trim, max_tokens)
        logp = by_row(micro, model.forward(micro, logprobs), B, S)
        if reference is None:
            reference = logp
        diff = float(((logp - reference).abs() * rollout.mask_BS).max())
        computed = sum(mb["tokens"].numel() for mb in micro)
        rows.append(
            {
                "trim": trim,
                "max_tokens": max_tokens,
                "micro_batches": len(micro),
                "padding": 1.0 - float(rollout.lengths_B.sum()) / computed,
                "widths": sorted({mb["tokens"].shape[1] for mb in micro}),
                "logprob_diff_max": diff,
                "forward_s": seconds(lambda m=micro: model.forward(m, logprobs)),
            }
        )
    for row in rows:
        micro = micro_batches(rollout, None, args.micro_batch, row["trim"], row["max_tokens"])
        row["step_s"] = seconds(lambda m=micro: model.step(m, loss))
    print(f"{B} rollouts of {args.prompt} + U({args.min_response}, {args.max_response}) tokens, width {S + 1}")
    print("| trim | micro-batches | padding | micro-batch widths | log-probs s | update step s | log-prob diff max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        widths = f"{r['widths'][0]}..{r['widths'][-1]} ({len(r['widths'])})"
        print(
            f"| {name_of(r)} | {r['micro_batches']} | {r['padding']:.3f} | {widths} | {r['forward_s']:.3f} "
            f"| {r['step_s']:.3f} | {r['logprob_diff_max']:.3g} |"
        )
    device = torch.cuda.get_device_name() if gpu else "cpu"
    return write_report({"device": device, "args": vars(args), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
