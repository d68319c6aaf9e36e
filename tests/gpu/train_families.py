"""GPU check (run by hand on a GPU machine, not collected by pytest): the training forward and backward of each model
family with the GPU's defaults (the Triton RoPE kernel, compiled log-prob chunks, megatron's fused bias-dropout-add and
SwiGLU) against the same bf16 model with aligner's fusions off and against a float32 copy, on the same GPU.

Families: those of tests/gpu/engine_families.py (Llama with a qkv bias, Llama 3.2-style, Qwen3-style, GPT-2). Per
family, random sequences; the loss is the mean log-prob of the sequences' tokens (what the policy losses are made
of), by aligner.models.logprobs.vocab_parallel_logprobs (with the entropy, as the actor computes it). Reported: mean
|log-prob difference| a token against float32, and each weight gradient's relative error ||g - g32|| / ||g32||
(median and largest over the weights), for the fused and the unfused bf16 model.

PASS: the fused model no farther from float32 than 1.5x the unfused one (plus 1e-3 nats / 0.01 relative, for float32
runs where those are ~0), in log-probs, entropies and the largest gradient error. Prints one line per family and a
table; exit 1 on any FAIL.

    python3 tests/gpu/train_families.py [--out report.json]
    python3 tests/gpu/train_families.py --tiny        (CPU: the script itself; --fusion on compiles there too)
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_families import FAMILIES, finish, random_model, rebuilt, tiny  # noqa: E402

LIMIT_TO_UNFUSED, LOGP_SLACK, GRAD_SLACK = 1.5, 1e-3, 0.01  # see the module docstring


def loss_and_grads(model, tokens_BT, vocab: int, fusion: str):
    """(log-probs [B, T-1], entropies [B, T-1], {name: gradient as float32}) of the mean log-prob of the tokens."""
    from aligner.models import logprobs
    from aligner.models.gpt import forward

    logprobs.set_fusion(fusion)
    model.train()
    model.zero_grad(set_to_none=True)
    logits, targets = logprobs.shift_for_next_token(forward(model, tokens_BT), tokens_BT)
    logp, entropy = logprobs.vocab_parallel_logprobs(logits, targets, None, vocab_size=vocab, with_entropy=True)
    (logp.mean() + 0.01 * entropy.mean()).backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logp.detach().float(), entropy.detach().float(), grads


def distance(run, reference) -> dict:
    logp, entropy, grads = run
    ref_logp, ref_entropy, ref_grads = reference
    errors = sorted(
        float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items() if g.norm() > 0
    )
    return {
        "logp_mean": float((logp - ref_logp).abs().mean()),
        "entropy_mean": float((entropy - ref_entropy).abs().mean()),
        "grad_median": errors[len(errors) // 2],
        "grad_max": errors[-1],
        "grads": len(errors),
    }


def run_family(name, cfg, args, device) -> dict:
    fused = random_model(replace(cfg, rope_fusion=args.fusion, logprob_fusion=args.fusion))
    unfused = rebuilt(fused, cfg, rope_fusion="off", logprob_fusion="off")
    reference = rebuilt(fused, cfg, params_dtype="float32", rope_fusion="off", logprob_fusion="off")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g).to(device)
    ref = loss_and_grads(reference, tokens, cfg.vocab_size, "off")
    row = {
        "family": name,
        "fusion": args.fusion,
        "rope_fused": bool(fused.config.apply_rope_fusion),
        "fused": distance(loss_and_grads(fused, tokens, cfg.vocab_size, args.fusion), ref),
        "unfused": distance(loss_and_grads(unfused, tokens, cfg.vocab_size, "off"), ref),
    }
    f, u = row["fused"], row["unfused"]
    row["pass"] = (
        f["logp_mean"] <= LIMIT_TO_UNFUSED * u["logp_mean"] + LOGP_SLACK
        and f["entropy_mean"] <= LIMIT_TO_UNFUSED * u["entropy_mean"] + LOGP_SLACK
        and f["grad_max"] <= LIMIT_TO_UNFUSED * u["grad_max"] + GRAD_SLACK
        and f["grads"] == u["grads"] > 0
    )
    print(
        f"{'PASS' if row['pass'] else 'FAIL'} {name}: log-probs vs float32 {f['logp_mean']:.4f} fused / "
        f"{u['logp_mean']:.4f} unfused, gradients' largest relative error {f['grad_max']:.4f} / {u['grad_max']:.4f} "
        f"(median {f['grad_median']:.4f} / {u['grad_median']:.4f}), RoPE fused: {row['rope_fused']}",
        flush=True,
    )
    del fused, unfused, reference
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2-layer models, fp32 on the CPU: the script itself")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--fusion", choices=("auto", "on"), default="auto", help="model.rope_fusion / logprob_fusion")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 8; tiny: 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens a sequence (default 256; tiny: 12)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.seq_len = args.seq_len or (12 if args.tiny else 256)

    from aligner.parallel import initialize

    initialize(1, 1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = [run_family(n, tiny(FAMILIES[n]) if args.tiny else FAMILIES[n], args, device) for n in args.families]
    print("\n| family | RoPE fused | log-probs vs fp32, fused / unfused | entropies | largest grad. error | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        f, u = r["fused"], r["unfused"]
        print(
            f"| {r['family']} | {r['rope_fused']} | {f['logp_mean']:.4f} / {u['logp_mean']:.4f} | "
            f"{f['entropy_mean']:.4f} / {u['entropy_mean']:.4f} | {f['grad_max']:.4f} / {u['grad_max']:.4f} | "
            f"{'PASS' if r['pass'] else 'FAIL'} |"
        )
    return finish(rows, args.out, device)


if __name__ == "__main__":
    sys.exit(main())
