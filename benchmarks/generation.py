"""Generation benchmark: the native engine against HF transformers `generate` on the same weights.

What is measured (scripts/bench_generation.py prints it as a table and writes JSON):
- copy bandwidth: a device-to-device copy of 1 GiB (CPU: 256 MiB), counting bytes read plus written;
- refit: `engine.refit(policy)` in ms, against its floor = 2 x weight bytes / copy bandwidth;
- per batch size, each timed after a full warm-up run of the same call (which also captures the CUDA graphs):
  native greedy and native sampling (temperature 1), HF `generate` greedy with its default dynamic cache and with
  cache_implementation="static"; tokens/s = batch x new tokens / wall time of the whole call (prefill included);
- native decode ms/step (CUDA events around the decode loop) against the floor: mean over the decode steps of
  (weight bytes + KV bytes of every cached token) / copy bandwidth;
- numerics: the engine's log-probs against megatron's forward (the training path) on the generated tokens, and the
  HF model's logits against megatron's on the prompts (checks the weight conversion).
Every response is forced to `new_tokens` tokens (ignore_eos; HF: no EOS id).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from functools import partial

import torch

from aligner.config.schema import ModelConfig
from aligner.generation import GenerationConfig, SamplingParams, build_engine
from benchmarks.profiling import format_profile, profile_call
from benchmarks.shapes import PRESETS, model_from_hf_config

TINY_MODEL = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=256,
    init_method_std=0.2,
)


def bench_model(preset: str = "1b") -> ModelConfig:
    """The generation benchmarks' model: "tiny" (the CPU smoke shape above) or a Llama-style shape of
    benchmarks.shapes.PRESETS in bf16 with random weights ("1b": issue 17's goals are set on it; "8b": issue 12's)."""
    if preset == "tiny":
        return TINY_MODEL
    return ModelConfig(arch="llama", **PRESETS[preset], params_dtype="bfloat16")


BENCH_MODEL = bench_model("1b")


@dataclass
class BenchArgs:
    batch_sizes: tuple[int, ...] = (64, 256)
    prompt_len: int = 128
    new_tokens: int = 256
    tiny: bool = False
    preset: str = "1b"  # bench_model's shape (not with tiny)
    hf_config: str | None = None  # a Hugging Face config.json's shape instead (model_from_hf_config)
    skip_hf: bool = False
    hf_compile: bool = True
    seed: int = 0
    profile: bool = False  # a torch-profiler table of the kernels of one greedy call at the largest batch
    profile_kernels: int = 15  # its rows: the kernels taking the most time
    decode_attention: str = "auto"  # generation.decode_attention
    decode_weights: str = "same"  # generation.decode_weights (fp8: FP8 MLP/output weights in decode steps)
    decode_gemm: str = "auto"  # generation.decode_gemm (splitk: decode's proj/fc2 by the split-K Triton kernel)
    kv_dtype: str = "auto"  # generation.kv_dtype (fp8: an e4m3 KV cache)
    token_choice: str = "auto"  # generation.token_choice (triton: greedy / plain sampling by two Triton kernels)
    ragged: bool = False  # prompt lengths drawn from [prompt_len / 4, prompt_len] (native engine only)
    samples_per_prompt: int = 1  # each prompt in this many neighbouring rows, as a GRPO group (prefilled once)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device):
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def copy_bandwidth(device) -> float:
    """Bytes read + written per second by a large tensor copy."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 20 if device.type == "cuda" else 3
    _, seconds = _timed(lambda: [dst.copy_(src) for _ in range(reps)], device)
    return 2 * nbytes * reps / seconds


def build_hf_llama(module, cfg: ModelConfig, device, dtype):
    """The HF LlamaForCausalLM holding a TP=1 megatron policy's weights (aligner.checkpoint.hf's mapping)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from aligner.checkpoint.hf import hf_config_for_export, weight_map

    sd = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}

    def read(name):  # full TP=1 tensors with the unpadded vocabulary, as the mapping expects
        t = sd[name]
        return t[: cfg.vocab_size] if name in ("embedding.word_embeddings.weight", "output_layer.weight") else t

    wmap = weight_map(cfg, "policy")
    hf_sd = {}
    for part in wmap.parts():
        hf_sd.update(wmap.to_hf(part, read))
    hf_cfg = LlamaConfig.from_dict(hf_config_for_export(cfg, "policy", None, "bfloat16"))
    model = LlamaForCausalLM(hf_cfg).to(device=device, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"HF weight mapping incomplete: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_generate(model, prompts, new_tokens, static: bool, compile_static: bool):
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    if static:
        kwargs["cache_implementation"] = "static"
        if not compile_static:
            kwargs["disable_compile"] = True
    out = model.generate(prompts, attention_mask=torch.ones_like(prompts), **kwargs)
    if out.shape[1] != prompts.shape[1] + new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - prompts.shape[1]} tokens, expected {new_tokens}")
    return out


def reference_logprobs(module, cfg, prompts, lengths, out, rows: int, rounding=None) -> list[torch.Tensor]:
    """Megatron's forward (the training path) log-probs of the first `rows` samples' generated tokens, each sample
    with its own prompt length; `rounding(prompt_length, sequence_length)`, where given, is a context manager around
    each sample's forward (aligner.generation.native.replay's)."""
    from aligner.models.gpt import forward
    from aligner.models.logprobs import shift_for_next_token, vocab_parallel_logprobs

    refs = []
    for b in range(min(rows, prompts.shape[0])):
        n = int(lengths[b])
        seq = torch.cat([prompts[b, :n], out.response_tokens_BR[b]]).unsqueeze(0)
        context = contextlib.nullcontext() if rounding is None else rounding(n, seq.shape[1])
        with torch.no_grad(), context:
            logits, targets = shift_for_next_token(forward(module, seq), seq)
            refs.append(vocab_parallel_logprobs(logits, targets, vocab_size=cfg.vocab_size)[0, n - 1 :])
    return refs


def logprob_gap(refs: list[torch.Tensor], logprobs_BR: torch.Tensor) -> dict[str, float]:
    """Mean and max |ref - logprobs| over reference_logprobs' samples (the first rows of logprobs_BR)."""
    gap = torch.stack([(ref - logprobs_BR[b]).abs() for b, ref in enumerate(refs)])
    return {"logp_abs_diff_mean": float(gap.mean()), "logp_abs_diff_max": float(gap.max())}


def _prompts(args, B: int, vocab: int, rng: torch.Generator, device):
    """B prompts of args.prompt_len tokens, or with `ragged` lengths drawn uniformly from [prompt_len / 4,
    prompt_len] (right-padded): what real prompt data looks like to the engine. With `samples_per_prompt` n > 1, B / n
    prompts, each in n neighbouring rows (a GRPO group's samples)."""
    n = getattr(args, "samples_per_prompt", 1)
    if n < 1 or B % n:
        raise ValueError(f"batch {B} is not a whole number of groups of {n} samples per prompt")
    prompts = torch.randint(0, vocab, (B // n, args.prompt_len), generator=rng)
    lengths = torch.full((B // n,), args.prompt_len, dtype=torch.long)
    if args.ragged:
        lengths = torch.randint(max(1, args.prompt_len // 4), args.prompt_len + 1, (B // n,), generator=rng)
    if n > 1:
        prompts, lengths = prompts.repeat_interleave(n, dim=0), lengths.repeat_interleave(n)
    return prompts.to(device), lengths.to(device)


def run(args: BenchArgs) -> dict:
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    initialize(1, 1)
    torch.manual_seed(args.seed)
    cfg = model_from_hf_config(args.hf_config) if args.hf_config else bench_model("tiny" if args.tiny else args.preset)
    policy = build_gpt(cfg).eval()
    device = next(policy.parameters()).device
    gen = GenerationConfig(
        max_batch_size=max(args.batch_sizes),
        max_prompt_length=args.prompt_len,
        max_response_length=args.new_tokens,
        decode_attention=args.decode_attention,
        decode_weights=args.decode_weights,
        decode_gemm=args.decode_gemm,
        kv_dtype=args.kv_dtype,
        token_choice=args.token_choice,
    )
    engine = build_engine(gen, cfg, policy)
    bw = copy_bandwidth(device)
    weight_bytes = engine.decoder.decode_weight_bytes()  # what a decode step reads (FP8 copies where they are used)
    kv_token_bytes = engine.decoder.kv_bytes_per_token()

    refit_ms = []
    for _ in range(3):
        engine.refit(policy)
    for _ in range(10):
        refit_ms.append(_timed(lambda: engine.refit(policy), device)[1] * 1e3)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": "tiny" if args.tiny else None if args.hf_config else args.preset,
        "hf_config": args.hf_config,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "num_query_groups",
                "ffn_hidden_size",
                "vocab_size",
                "params_dtype",
            )
        },
        "engine_dtype": str(engine.weights.dtype),
        "decode_attention": engine.decode_attention,
        "decode_weights": args.decode_weights,
        "kv_dtype": str(engine.decoder.kv_dtype),
        "decode_gemm": engine.decode_gemm,
        "token_choice": engine.token_choice,
        "cuda_graphs": engine.use_graphs,
        "prompt_len": args.prompt_len,
        "ragged": args.ragged,
        "samples_per_prompt": args.samples_per_prompt,
        "new_tokens": args.new_tokens,
        "copy_bandwidth_GBps": bw / 1e9,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_token_bytes,
        "refit_ms": min(refit_ms),
        "refit_floor_ms": 2 * engine.weights.nbytes() / bw * 1e3,
        "rows": [],
    }
    hf = None
    if not args.skip_hf:
        hf = build_hf_llama(policy, cfg, device, engine.weights.dtype)
    gen_rng = torch.Generator().manual_seed(args.seed + 1)
    for B in args.batch_sizes:
        prompts, lengths = _prompts(args, B, cfg.vocab_size, gen_rng, device)
        row = {"batch": B, "prompt_tokens_mean": float(lengths.float().mean())}
        for name, sp in (
            ("native_greedy", SamplingParams(greedy=True, ignore_eos=True)),
            ("native_sample", SamplingParams(temperature=1.0, ignore_eos=True, seed=1)),
        ):
            engine.generate(prompts, lengths, sp)  # warm-up (captures the graphs on first use)
            out, seconds = _timed(partial(engine.generate, prompts, lengths, sp), device)
            if int(out.response_lengths_B.min()) != args.new_tokens:
                raise RuntimeError(f"{name}: responses shorter than {args.new_tokens} despite ignore_eos")
            row[f"{name}_tok_s"] = B * args.new_tokens / seconds
            t = engine.last_timings
            row[f"{name}_prefill_ms"] = t["prefill_ms"]
            row[f"{name}_decode_ms_per_step"] = t["decode_ms"] / max(1, t["decode_steps"])
            if name == "native_greedy":
                row.update(logprob_gap(reference_logprobs(policy, cfg, prompts, lengths, out, 8), out.logprobs_BR))
                greedy_tokens = out.response_tokens_BR
        steps = range(1, args.new_tokens)
        row["decode_floor_ms_per_step"] = (
            sum((weight_bytes + kv_token_bytes * int((lengths + s).sum())) / bw for s in steps) / len(steps) * 1e3
        )
        row["decode_vs_floor"] = row["native_greedy_decode_ms_per_step"] / row["decode_floor_ms_per_step"]
        if hf is not None:
            with torch.no_grad():
                hf_logits = hf(prompts[:4]).logits.float()
                from aligner.models.gpt import forward

                mg_logits = forward(policy, prompts[:4])[..., : cfg.vocab_size].float()
            row["hf_vs_megatron_logit_maxdiff"] = float((hf_logits - mg_logits).abs().max())
            row["logit_std"] = float(mg_logits.std())
            for name, static in (("hf_dynamic", False), ("hf_static", True)):
                with torch.no_grad():
                    _hf_generate(hf, prompts, args.new_tokens, static, args.hf_compile)  # warm-up
                    hf_out, seconds = _timed(
                        partial(_hf_generate, hf, prompts, args.new_tokens, static, args.hf_compile), device
                    )
                row[f"{name}_tok_s"] = B * args.new_tokens / seconds
                # greedy agreement with the native engine: 1.0 in float32; bf16 rounding flips near-ties after a while
                same = (hf_out[:, args.prompt_len :] == greedy_tokens).long()
                row[f"{name}_same_first_token"] = float(same[:, 0].float().mean())
                row[f"{name}_common_prefix_frac"] = float(same.cumprod(1).sum(1).float().mean() / args.new_tokens)
            row["speedup_vs_hf_static"] = row["native_greedy_tok_s"] / row["hf_static_tok_s"]
        report["rows"].append(row)
    if args.profile:
        B = max(args.batch_sizes)
        prompts, lengths = _prompts(args, B, cfg.vocab_size, gen_rng, device)
        report["profile"] = profile_generate(engine, prompts, lengths, device, args.profile_kernels)
    report["goals"] = {
        "3x_hf_static": None if hf is None else all(r["speedup_vs_hf_static"] >= 3 for r in report["rows"]),
        "decode_within_1.5x_floor": all(r["decode_vs_floor"] <= 1.5 for r in report["rows"]),
        "refit_under_20ms": report["refit_ms"] < 20,
    }
    return report


def profile_generate(engine, prompts, lengths, device, top: int = 15) -> dict:
    """One greedy `generate` (after a warm-up) under torch.profiler (benchmarks.profiling). Kernels replayed inside
    CUDA graphs are listed where the profiler sees them (CUPTI records graph kernels on recent drivers)."""
    sp = SamplingParams(greedy=True, ignore_eos=True)
    engine.generate(prompts, lengths, sp)
    prof = profile_call(lambda: engine.generate(prompts, lengths, sp), device, top)
    return {"batch": int(prompts.shape[0]), **prof}


def format_generate_profile(prof: dict) -> str:
    return format_profile(prof, f"one greedy call at batch {prof['batch']}")


def format_table(report: dict) -> str:
    lines = [
        (
            f"device {report['device']}, engine {report['engine_dtype']}, cuda_graphs={report['cuda_graphs']}, "
            f"decode attention {report.get('decode_attention', 'matmul')}, "
            f"decode weights {report.get('decode_weights', 'same')}, "
            f"KV cache {report.get('kv_dtype', 'in the engine dtype')}, "
            f"decode GEMMs {report.get('decode_gemm', 'cublas')}, "
            f"token choice {report.get('token_choice', 'torch')}, "
            f"prompt {'up to ' if report.get('ragged') else ''}{report['prompt_len']} + {report['new_tokens']} new "
            f"tokens{' (ragged prompt lengths)' if report.get('ragged') else ''}"
            + (f", {report['samples_per_prompt']} samples a prompt" if report.get("samples_per_prompt", 1) > 1 else "")
        ),
        (
            f"copy bandwidth {report['copy_bandwidth_GBps']:.0f} GB/s (read+write); weights "
            f"{report['weight_bytes'] / 1e9:.3f} GB; KV {report['kv_bytes_per_token'] / 1024:.1f} KiB/token"
        ),
        f"refit {report['refit_ms']:.2f} ms (floor {report['refit_floor_ms']:.2f} ms)",
        "",
    ]
    cols = [
        ("batch", "{:d}"),
        ("native_greedy_tok_s", "{:,.0f}"),
        ("native_sample_tok_s", "{:,.0f}"),
        ("hf_dynamic_tok_s", "{:,.0f}"),
        ("hf_static_tok_s", "{:,.0f}"),
        ("speedup_vs_hf_static", "{:.2f}x"),
        ("native_greedy_decode_ms_per_step", "{:.3f}"),
        ("decode_floor_ms_per_step", "{:.3f}"),
        ("decode_vs_floor", "{:.2f}x"),
        ("native_greedy_prefill_ms", "{:.1f}"),
        ("logp_abs_diff_max", "{:.2e}"),
    ]
    heads = [
        "B",
        "native tok/s",
        "sample tok/s",
        "HF dyn tok/s",
        "HF static tok/s",
        "vs static",
        "decode ms/step",
        "floor ms",
        "vs floor",
        "prefill ms",
        "max|dlogp|",
    ]
    rows = [heads] + [[fmt.format(r[k]) if r.get(k) is not None else "-" for k, fmt in cols] for r in report["rows"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(heads))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    goals = ", ".join(f"{k}: {'-' if v is None else ('PASS' if v else 'FAIL')}" for k, v in report["goals"].items())
    lines += ["", f"goals: {goals}"]
    if any(not math.isfinite(r.get("logp_abs_diff_max", 0.0)) for r in report["rows"]):
        lines.append("WARNING: non-finite log-prob differences")
    return "\n".join(lines)
