"""Probe (issue 17, forty-second session): is the FP8 decode path's log-prob gap its rounding, or more?

bench_generation.py sets the engine's log-probs against megatron's forward on the generated tokens. With
`generation.decode_weights: fp8` that gap grew with the model on one H100 (random weights, 64 rows: mean 0.2 nats a
token at 1B, 1.0 at 8B; 0.55 at 8B with decode_gemm=cublas, whose copies leave qkv in bf16). Here the same gap is
also taken against megatron's forward with the engine's rounding replayed: every weight the engine holds an e4m3 copy
of (fc1, fc2, the output layer and, where its copies include it, qkv) replaced by its row-quantized value
(fp8.quantize_rows, the engine's rule), and every input of those layers rounded per row the same way (forward
pre-hooks). If the engine computes what it should, the gap against that forward is near the bf16 engine's against the
plain one; what is left beyond that is the engine's own.

    python3 benchmarks/probes/fp8_reference.py --preset 8b --batch-sizes 64 [--kv-dtype fp8] [--out result.json]
    python3 benchmarks/probes/fp8_reference.py --tiny --batch-sizes 3      (CPU: the torch FP8 path, no qkv copies)
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, bench_policy, engine_choices, engine_parser, write_report  # noqa: E402


def fp8_layers(engine) -> list[str]:
    """Megatron module names (GPTModel's) whose weights the engine holds e4m3 copies of, from its copies' names."""
    names = engine.decoder.fp8.names
    return [n.removesuffix(".weight") if n != "output" else "output_layer" for n in names]


def round_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the engine rounds a GEMM operand: e4m3 with one scale per row (fp8.quantize_rows), in x's dtype."""
    from aligner.generation.native import fp8

    x8, scale = fp8.quantize_rows(x)
    return (x8.float() * scale).to(x.dtype)


@torch.no_grad()
def replay_rounding(module: torch.nn.Module, layers: list[str]) -> list:
    """Round `layers`' weights in place and their inputs on every call (returns the hooks' handles). The names are
    GPTModel's; a wrapper's prefix is allowed."""
    found, handles = set(), []
    for name, sub in module.named_modules():
        layer = next((n for n in layers if name == n or name.endswith("." + n)), None)
        if layer is None:
            continue
        found.add(layer)
        sub.weight.copy_(round_rows(sub.weight))
        handles.append(sub.register_forward_pre_hook(lambda _m, args: (round_rows(args[0]), *args[1:])))
    missing = sorted(set(layers) - found)
    if missing:
        raise ValueError(f"fp8_reference: the model has no {missing}")
    return handles


def main(argv=None) -> dict:
    parser = engine_parser(__doc__, repeats=1)
    parser.set_defaults(decode_weights="fp8")
    parser.add_argument("--tiny", action="store_true", help="bench_generation's 2-layer model (CPU smoke run)")
    parser.add_argument("--rows", type=int, default=8, help="samples whose log-probs are compared (default 8)")
    args = parser.parse_args(argv)

    from aligner.generation import SamplingParams
    from benchmarks.generation import _logprob_gap, _prompts, bench_model

    cfg = bench_model("tiny" if args.tiny else args.preset)
    prompt_len, new_tokens = (16, 16) if args.tiny else (128, 256)
    policy = bench_policy(args, cfg)
    engine, device = bench_engine(args, cfg, prompt_len, new_tokens, policy=policy)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "args": vars(args)}
    report["engine"] = engine_choices(engine)
    report["fp8_layers"] = layers = fp8_layers(engine) if engine.decoder.fp8 is not None else []
    rng = torch.Generator().manual_seed(1)
    prompt_args = argparse.Namespace(prompt_len=prompt_len, ragged=False)
    outputs = []
    for B in args.batch_sizes:
        prompts, lengths = _prompts(prompt_args, B, cfg.vocab_size, rng, device)
        out = engine.generate(prompts, lengths, SamplingParams(greedy=True, ignore_eos=True))
        outputs.append((B, prompts, lengths, out))
        report[str(B)] = {"plain": _logprob_gap(policy, cfg, prompts, lengths, out, rows=args.rows)}
    handles = replay_rounding(policy, layers)
    for B, prompts, lengths, out in outputs:
        row = report[str(B)]
        row["replayed"] = _logprob_gap(policy, cfg, prompts, lengths, out, rows=args.rows)
        print(
            f"B={B} engine log-probs against megatron's forward, mean / max nats a token: plain "
            f"{row['plain']['logp_abs_diff_mean']:.4f} / {row['plain']['logp_abs_diff_max']:.4f}, the engine's FP8 "
            f"rounding replayed {row['replayed']['logp_abs_diff_mean']:.4f} / "
            f"{row['replayed']['logp_abs_diff_max']:.4f} ({len(layers)} layers rounded)",
            flush=True,
        )
    for h in handles:
        h.remove()
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
