"""GPU check (run by hand on a GPU machine, not collected by pytest): the generation engine with its GPU paths (Triton
decode attention, split-K / FP8 GEMMs, compiled kernels, CUDA graphs) on each model family the conversions bring in,
against megatron's own forward of the same sequences on the same GPU.

Families, at small sizes with peaked output distributions (init std 0.08): Llama with GQA and a qkv bias (Qwen2's
shape), Llama 3.2-style (llama3 RoPE scaling, tied embeddings), Qwen3-style (per-head q/k norms, head width 128 !=
hidden / heads), Phi-3.5-style (LongRoPE: short factors, its attention factor as the attention's scale),
Phi-4-mini-style (the same over 3/4 of each head, the rest passed through), GPT-2
(learned positions, LayerNorm, GELU, biases, tied). Each with the engine's defaults and with
FP8 decode weights and an FP8 KV cache (`generation.decode_weights` / `kv_dtype`). Per case, ragged prompts:

- greedy: the engine's log-probs against megatron's forward of the engine's sequences (one pass) in the model's dtype
  and in float32 (the same weights); where the forward's argmax is not the engine's token, the forward's log-prob
  gap between the two;
- sampled (T = 1, seeded): the same comparisons;
- refit: the policy's weights changed (as an optimizer step changes them), engine.refit, greedy again: compared with
  the changed model, and the tokens must differ from the first greedy call's.

PASS: with the engine's own dtype, the engine no farther from the float32 forward (mean over tokens) than 1.5x the
bf16 forward is (bf16's rounding is the yardstick: a kernel that computes something else lands far outside it); with
FP8 weights or an FP8 cache (another policy by design; the CPU tests hold those to megatron with the same rounding)
a mean under 1 nat (a broken kernel's tokens are noise). Prints one line per case and a table; exit 1 on any FAIL.

    python3 tests/gpu/engine_families.py [--out report.json]
    python3 tests/gpu/engine_families.py --tiny           (CPU: the script itself; engine defaults of the CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from aligner.config.schema import ModelConfig  # noqa: E402


def longrope_factors(pairs: int) -> dict:
    """LongRoPE's short and long factors for `pairs` frequencies (head width / 2): rising from 1 to 11, and 4x."""
    short = [round(1 + 10 * (i / (pairs - 1)) ** 2, 4) for i in range(pairs)]
    return dict(rope_scaling_short_factor=short, rope_scaling_long_factor=[4 * f for f in short])


BASE = dict(
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=1536,
    vocab_size=4000,
    init_method_std=0.08,
    params_dtype="bfloat16",
)
FAMILIES = {
    "llama-qkv-bias": ModelConfig(arch="llama", add_qkv_bias=True, **BASE),
    "llama3.2-style": ModelConfig(
        arch="llama",
        tie_embeddings=True,
        rope_scaling="llama3",
        rope_scaling_factor=32.0,
        rope_scaling_original_max_position_embeddings=64,
        **BASE,
    ),
    "qwen3-style": ModelConfig(arch="llama", head_dim=128, qk_layernorm=True, rotary_base=1e6, **BASE),
    # Phi-3.5's LongRoPE within its pre-training context: short factors, and Phi-3.5's attention factor (4096 of
    # 131072 positions pre-trained: sqrt(1 + ln 32 / ln 4096)) as the attention's scale
    "phi3.5-style": ModelConfig(
        arch="phi3",
        rope_scaling="longrope",
        rope_scaling_original_max_position_embeddings=2048,
        rope_scaling_attention_factor=(1 + math.log(32) / math.log(4096)) ** 0.5,
        **longrope_factors(32),
        **BASE,
    ),
    # Phi-4-mini's: the same over 3/4 of each head (48 of 64 channels), the rest passed through
    "phi4-mini-style": ModelConfig(
        arch="phi3",
        rope_scaling="longrope",
        rope_scaling_original_max_position_embeddings=2048,
        rope_scaling_attention_factor=(1 + math.log(32) / math.log(4096)) ** 0.5,
        rotary_percent=0.75,
        **longrope_factors(24),
        **BASE,
    ),
    # SmolLM3's: RoPE left out of every fourth layer (here the last), tied embeddings, its RoPE base
    "smollm3-style": ModelConfig(arch="llama", tie_embeddings=True, rotary_base=5e6, nope_layers=[3], **BASE),
    "gpt2": ModelConfig(
        arch="gpt2",
        tie_embeddings=True,
        max_position_embeddings=256,
        **{**BASE, "num_query_groups": None, "ffn_hidden_size": 2048},
    ),
}
VARIANTS = {"engine dtype": {}, "fp8 weights": {"decode_weights": "fp8"}, "fp8 kv": {"kv_dtype": "fp8"}}
LIMIT_TO_NOISE, SLACK, FP8_MEAN_LIMIT = 1.5, 1e-3, 1.0  # see verdict


def tiny(cfg: ModelConfig) -> ModelConfig:
    return replace(
        cfg,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2 if cfg.num_query_groups else None,
        ffn_hidden_size=96,
        vocab_size=250,
        head_dim=24 if cfg.head_dim else None,
        init_method_std=0.2,
        params_dtype="float32",
        **(longrope_factors(int(16 * cfg.rotary_percent) // 2) if cfg.rope_scaling == "longrope" else {}),
        nope_layers=[1] if cfg.nope_layers else [],  # the last of the two layers
    )


def forward_logprobs(model, prompts_BT, lengths_B, out, temperature: float, vocab: int):
    """log_softmax(logits / T) of each response token by megatron's forward of the whole sequence, [B, R] (0 past
    the end), and where the forward's argmax differs from the engine's token, the log-prob gap to that argmax."""
    from aligner.models.gpt import forward

    B, R = out.response_tokens_BR.shape
    n_B = out.response_lengths_B.tolist()
    seqs = [
        prompts_BT[b, : int(lengths_B[b])].tolist() + out.response_tokens_BR[b, : n_B[b]].tolist() for b in range(B)
    ]
    width = max(len(s) for s in seqs)
    device = prompts_BT.device
    tokens = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device=device)
    with torch.no_grad():
        logp_BTV = torch.log_softmax(forward(model, tokens)[..., :vocab].float() / temperature, dim=-1)
    logp, gaps = torch.zeros(B, R, device=device), []
    for b in range(B):
        p, n = int(lengths_B[b]), int(out.response_lengths_B[b])
        rows = logp_BTV[b, p - 1 : p - 1 + n]
        chosen = out.response_tokens_BR[b, :n].to(device)
        logp[b, :n] = rows.gather(-1, chosen[:, None])[:, 0]
        best = rows.max(-1).values
        gaps += (best - logp[b, :n])[rows.argmax(-1) != chosen].tolist()
    return logp, gaps


def random_model(cfg: ModelConfig):
    """A seeded random model of `cfg`; q/k norm weights (built as ones) moved off 1, so that a norm applied wrongly
    shows."""
    from aligner.models.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(cfg)
    if cfg.qk_layernorm:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.2 * torch.randn_like(p))
    return model


def rebuilt(model, cfg: ModelConfig, **fields):
    """The same weights in a model of `cfg` with `fields` changed (e.g. params_dtype="float32": the reference whose
    distance from the bf16 forward is bf16's own rounding)."""
    from aligner.models.gpt import build_gpt

    copy = build_gpt(replace(cfg, **fields)).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def compare(model, cfg: ModelConfig, engine, prompts, lengths, sampling) -> dict:
    """The engine's log-probs against megatron's forward of its sequences, in the model's dtype and in float32."""
    out = engine.generate(prompts, lengths, sampling)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    ref, gaps = forward_logprobs(model, prompts, lengths, out, temperature, cfg.vocab_size)
    model32 = rebuilt(model, cfg, params_dtype="float32")
    ref32, _ = forward_logprobs(model32, prompts, lengths, out, temperature, cfg.vocab_size)
    lengths_B = out.response_lengths_B.to(ref.device)
    mask = torch.arange(out.logprobs_BR.shape[1], device=ref.device)[None] < lengths_B[:, None]
    engine_logp = out.logprobs_BR.to(ref.device)
    diff, diff32, noise = (engine_logp - ref).abs()[mask], (engine_logp - ref32).abs()[mask], (ref - ref32).abs()[mask]
    tokens = out.response_tokens_BR[mask.to(out.response_tokens_BR.device)]
    return {
        "tokens_": out.response_tokens_BR.tolist(),  # dropped from the report
        "tokens": int(mask.sum()),
        "valid_tokens": bool(((tokens >= 0) & (tokens < cfg.vocab_size)).all()),
        "mean_logp": round(float(ref[mask].mean()), 3),  # how peaked the distributions are (0: one-hot)
        "mismatch_mean": float(diff.mean()),  # engine vs the forward in the model's dtype
        "mismatch_max": float(diff.max()),
        "vs_fp32_mean": float(diff32.mean()),  # engine vs the float32 forward
        "vs_fp32_max": float(diff32.max()),
        "noise_mean": float(noise.mean()),  # the model's dtype's own forward vs the float32 one
        "noise_max": float(noise.max()),
        "argmax_disagreements": len(gaps) if sampling.greedy else None,
        "widest_gap": max(gaps) if sampling.greedy and gaps else 0.0,
    }


def verdict(row: dict, exact: bool) -> bool:
    """Exact variants: the engine no farther from the float32 forward than LIMIT_TO_NOISE times the model dtype's own
    forward (plus SLACK nats for float32 runs, where that is ~0); FP8 ones: FP8_MEAN_LIMIT."""
    ok = row["valid_tokens"]
    if exact:
        return ok and row["vs_fp32_mean"] <= LIMIT_TO_NOISE * row["noise_mean"] + SLACK
    return ok and row["vs_fp32_mean"] <= FP8_MEAN_LIMIT


def change_weights(model, seed: int) -> None:
    """What an optimizer step does to the engine's view: every weight changed, in place."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g).to(p.device, p.dtype))


def run_case(name, cfg, variant, args, device) -> list[dict]:
    from aligner.generation import GenerationConfig, SamplingParams, build_engine

    model = random_model(cfg).eval()
    gen = GenerationConfig(
        max_batch_size=args.batch,
        max_prompt_length=args.prompt_len,
        max_response_length=args.new_tokens,
        share_weights=args.share_weights,
        **VARIANTS[variant],
    )
    engine = build_engine(gen, cfg, model)
    rng = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=rng)
    lengths = torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (args.batch,), generator=rng)
    prompts, lengths = prompts.to(device), lengths.to(device)
    setting = {
        "decode_attention": engine.decode_attention,
        "decode_gemm": engine.decode_gemm,
        "cuda_graphs": engine.use_graphs,
        "kv": str(engine.decoder.kv.dtype).removeprefix("torch."),
    }
    greedy, sampled = SamplingParams(greedy=True), SamplingParams(temperature=1.0, seed=7)
    rows, before = [], None
    for what, sampling in (("greedy", greedy), ("sampled", sampled), ("greedy after refit", None)):
        if sampling is None:
            change_weights(model, 3)
            engine.refit(model)
            sampling = greedy
        row = {"family": name, "variant": variant, "what": what, **setting}
        row.update(compare(model, cfg, engine, prompts, lengths, sampling))
        row["pass"] = verdict(row, exact=not VARIANTS[variant])
        tokens = row.pop("tokens_")
        if what == "greedy":
            before = tokens
        elif what.endswith("refit"):  # a refit the engine ignored would answer as before: the tokens must change
            row["refit_changed_tokens"] = tokens != before
            row["pass"] = row["pass"] and tokens != before
        print(
            f"{'PASS' if row['pass'] else 'FAIL'} {name} / {variant} / {what}: vs fp32 mean {row['vs_fp32_mean']:.4f} "
            f"(the forward's own {row['noise_mean']:.4f}), vs the forward {row['mismatch_mean']:.4f} max "
            f"{row['mismatch_max']:.3f}, argmax disagreements {row['argmax_disagreements']} (widest "
            f"{row['widest_gap']:.3f}), mean log-prob {row['mean_logp']}, {setting}",
            flush=True,
        )
        rows.append(row)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def finish(rows: list[dict], out: str | None, device: torch.device) -> int:
    """Write the rows (with the device and torch version) to `out` if given; the exit code: 1 if any row failed."""
    if out:
        device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        with open(out + ".tmp", "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "rows": rows}, f, indent=1)
        os.replace(out + ".tmp", out)
    return 0 if all(r["pass"] for r in rows) else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2-layer models, fp32 on the CPU: the script itself")
    parser.add_argument("--families", nargs="+", choices=sorted(FAMILIES), default=sorted(FAMILIES))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    parser.add_argument("--batch", type=int, default=None, help="prompts per call (default 48; tiny: 3)")
    parser.add_argument("--prompt-len", type=int, default=None, help="longest prompt (default 48; tiny: 8)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens per response (default 64; tiny: 6)")
    parser.add_argument("--share-weights", choices=("auto", "off"), default="auto", help="generation.share_weights")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.batch = args.batch or (3 if args.tiny else 48)
    args.prompt_len = args.prompt_len or (8 if args.tiny else 48)
    args.new_tokens = args.new_tokens or (6 if args.tiny else 64)
    variants = args.variants or (["engine dtype"] if args.tiny else list(VARIANTS))

    from aligner.parallel import initialize

    initialize(1, 1)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    for name in args.families:
        cfg = tiny(FAMILIES[name]) if args.tiny else FAMILIES[name]
        for variant in variants:
            rows += run_case(name, cfg, variant, args, device)
    print(
        "\n| family | variant | what | attention / gemm / kv | vs fp32 mean / max | forward vs fp32 mean / max "
        "| vs forward mean / max | argmax off (widest) | result |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['family']} | {r['variant']} | {r['what']} | {r['decode_attention']} / {r['decode_gemm']} / {r['kv']}"
            f" | {r['vs_fp32_mean']:.4f} / {r['vs_fp32_max']:.3f} | {r['noise_mean']:.4f} / {r['noise_max']:.3f}"
            f" | {r['mismatch_mean']:.4f} / {r['mismatch_max']:.3f} | {r['argmax_disagreements']} "
            f"({r['widest_gap']:.3f}) | {'PASS' if r['pass'] else 'FAIL'} |"
        )
    return finish(rows, args.out, device)


if __name__ == "__main__":
    sys.exit(main())
