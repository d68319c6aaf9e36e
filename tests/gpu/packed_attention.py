"""GPU check (run by hand on a GPU machine, not collected by pytest): packed SFT rows through the samples' starts
(`aligner.models.attention.Segments`: PyTorch's variable-length flash kernel in bf16) against the dense block-diagonal
mask (SDPA), both against a float32 copy of the model with the mask, on the same GPU.

A Llama-style model with grouped KV heads; rows of `--width` tokens packed with random samples of 16 to `--longest`
tokens (the last sample of a row cut to fit; the row's rest padding). Reported per path: mean |log-prob difference| a
target token against float32 and each weight gradient's relative error ||g - g32|| / ||g32|| (median, largest);
whether the flash kernel ran (a CUDA kernel named flash in the profiler); forward + backward milliseconds a
micro-batch (median of 10 after 3).

PASS: the varlen path no farther from float32 than 1.5x the mask's (plus 1e-3 nats / 0.01 relative), and on a GPU
the flash kernel ran. Exit 1 on FAIL.

    python3 tests/gpu/packed_attention.py [--width 4096] [--rows 2] [--out report.json]
    python3 tests/gpu/packed_attention.py --tiny        (CPU: the script itself; the varlen path runs SDPA per sample)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LIMIT_TO_MASK, LOGP_SLACK, GRAD_SLACK = 1.5, 1e-3, 0.01  # see the module docstring


def build(tiny: bool, width: int, dtype: str):
    from aligner.config import ModelConfig
    from aligner.models.gpt import build_gpt

    shape = (
        {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 96}
        if tiny
        else {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8, "num_query_groups": 2}
    )
    cfg = ModelConfig(
        vocab_size=512, max_position_embeddings=width, params_dtype=dtype, attention_backend="sdpa", **shape
    )
    return build_gpt(cfg), cfg


def batch(rows: int, width: int, longest: int, vocab: int, device, seed: int = 0) -> dict:
    from aligner.data.packing import collate, packed_row
    from aligner.data.supervised import Sample

    rng = np.random.default_rng(seed)
    packed = []
    for _ in range(rows):
        samples, room = [], width - int(rng.integers(0, width // 16))  # some padding at the end of most rows
        while room >= 2:
            n = min(int(rng.integers(16, longest + 1)), room)
            samples.append(Sample(rng.integers(4, vocab, n), np.arange(n) >= 1))
            room -= n
        packed.append(packed_row(samples))
    return collate(packed, width, pad_id=0, device=device)


def run(model, mb: dict, varlen: bool):
    """(log-probs of the target tokens, {name: gradient as float32}) of their mean log-prob."""
    from aligner.models.attention import Segments

    model.zero_grad(set_to_none=True)
    tokens = mb["tokens"]
    if varlen:
        segments = Segments.of(mb["segment_ids"], device=tokens.device)
        logits = model(tokens, mb["position_ids"], attention_mask=None, packed_seq_params=segments)
    else:
        logits = model(tokens, mb["position_ids"], attention_mask=mb["attention_mask"])
    logp = logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    target = mb["targets"][:, 1:]
    logp[target].mean().backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach()[target], grads


def distance(result, reference) -> dict:
    (logp, grads), (ref_logp, ref_grads) = result, reference
    errors = sorted(
        float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items() if g.norm() > 0
    )
    return {
        "logp_mean": float((logp - ref_logp).abs().mean()),
        "grad_median": errors[len(errors) // 2],
        "grad_max": errors[-1],
    }


def flash_ran(model, mb) -> bool:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(model, mb, varlen=True)
        torch.cuda.synchronize()
    return any("flash" in e.key.lower() for e in prof.key_averages())


def millis(model, mb, varlen: bool) -> float:
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(model, mb, varlen)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--longest", type=int, default=1024, help="longest sample (tokens)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from aligner.parallel import initialize

    gpu = torch.cuda.is_available() and not args.tiny
    width = 64 if args.tiny else args.width
    longest = 20 if args.tiny else args.longest
    initialize(seed=11)
    model32, cfg = build(args.tiny, width, "float32")
    model16, _ = build(args.tiny, width, "float32" if args.tiny else "bfloat16")
    model16.load_state_dict(model32.state_dict())  # the same weights, rounded
    mb = batch(args.rows, width, longest, cfg.vocab_size, "cuda" if gpu else None)
    reference = run(model32, mb, varlen=False)
    report = {
        "width": width,
        "rows": args.rows,
        "samples": int(sum(int(r.max()) + 1 for r in mb["segment_ids"])),
        "mask": distance(run(model16, mb, varlen=False), reference),
        "varlen": distance(run(model16, mb, varlen=True), reference),
    }
    failures = []
    for key, slack in (("logp_mean", LOGP_SLACK), ("grad_max", GRAD_SLACK)):
        if report["varlen"][key] > LIMIT_TO_MASK * report["mask"][key] + slack:
            failures.append(f"varlen {key} {report['varlen'][key]:.3g} against the mask's {report['mask'][key]:.3g}")
    if gpu:
        report["flash_ran"] = flash_ran(model16, mb)
        if not report["flash_ran"]:
            failures.append("no flash kernel ran on the varlen path")
        report["ms_mask"], report["ms_varlen"] = millis(model16, mb, False), millis(model16, mb, True)
    print("| path | log-prob diff mean | grad rel err median | max | fwd+bwd ms |")
    print("|---|---|---|---|---|")
    for name in ("mask", "varlen"):
        d = report[name]
        ms = f"{report['ms_' + name]:.2f}" if gpu else "not run"
        print(f"| {name} | {d['logp_mean']:.3g} | {d['grad_median']:.3g} | {d['grad_max']:.3g} | {ms} |")
    print(
        f"{report['samples']} samples in {args.rows} rows of {width}; flash ran: {report.get('flash_ran', 'not run')}"
    )
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    if args.out:
        report["device"] = torch.cuda.get_device_name() if gpu else "cpu"
        report["pass"] = not failures
        with open(args.out + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
