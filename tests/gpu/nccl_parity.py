"""GPU check with NCCL (issue 7; run by hand on a machine with 2+ GPUs, not collected by pytest).

TP=2, PP=2 and DP=2 against one GPU on the same full weights, for a ~1B Llama-style model in bf16: log-probs, loss,
gradients, grad norm. At TP=2 also the generation engine: greedy tokens and log-probs against the engine at TP=1
(where greedy paths part, the reference's top-1/top-2 logit margin there), a refit after the optimizer step
(buffers unchanged, engine log-probs = training log-probs of the new weights) and a short speed table.

    python tests/gpu/nccl_parity.py ref DIR                    # one GPU: weights and reference results into DIR
    torchrun --nproc_per_node 2 tests/gpu/nccl_parity.py tp DIR
    torchrun --nproc_per_node 2 tests/gpu/nccl_parity.py pp DIR
    torchrun --nproc_per_node 2 tests/gpu/nccl_parity.py dp DIR

Each writes DIR/<mode>.json and prints a PASS/FAIL line with its numbers. Tolerances are bf16 ones: relative norm
errors (||x - ref|| / ||ref||) for gradients and losses, since elementwise bounds mean nothing after 16 layers of
bf16 rounding; log-prob differences against the noise floor that the reference run measures (see LOGP_FLOOR_FACTOR).
Results of the run on two H200s: docs/PERF.md ("Multi-GPU").
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TINY = os.environ.get("ALIGNER_PARITY_TINY") == "1"  # a CPU smoke run of this script (gloo, 2-layer model)
BATCH, SEQ = (4, 16) if TINY else (4, 1024)
GEN_B, GEN_PROMPT, GEN_NEW = (2, 8, 8) if TINY else (8, 64, 64)
# Log-prob tolerances are relative to the noise floor measured in the reference run: the mean |difference| between
# two correct bf16 implementations on one GPU (the engine and the training forward at TP=1, same weights and tokens).
LOGP_FLOOR_FACTOR = 1.5
TOL = {"grad_rel": 5e-2, "nll_rel": 2e-3, "grad_norm_rel": 2e-2}
LOGP_KEYS = ("logp_mean_abs", "engine_logp_mean_abs", "refit_engine_vs_training_logp_mean_abs")


def model_cfg():
    from aligner.config import ModelConfig

    if TINY:
        return ModelConfig(
            arch="llama",
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=128,
            vocab_size=256,
            make_vocab_size_divisible_by=16,
        )
    from benchmarks.shapes import PRESETS

    return ModelConfig(arch="llama", **PRESETS["1b"], params_dtype="bfloat16")  # the benchmarks' 1B model


def gen_cfg(max_batch=GEN_B, prompt=GEN_PROMPT, new=GEN_NEW):
    from aligner.generation import GenerationConfig

    return GenerationConfig(max_batch_size=max_batch, max_prompt_length=prompt, max_response_length=new)


def data(cfg):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    prompts = torch.randint(0, cfg.vocab_size, (GEN_B, GEN_PROMPT), generator=g)
    return tokens, prompts


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rel(a, b) -> float:
    a, b = a.float(), b.float().to(a.device)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def train_once(model, cfg, tokens):
    """Log-probs (forward only), then one optimizer step, over this rank's data-parallel share of `tokens`."""
    from megatron.core import parallel_state as ps

    from aligner.models.logprobs import default_tp_group, vocab_parallel_logprobs

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = BATCH // dp
    mine = tokens[dp_rank * share : (dp_rank + 1) * share].cuda()
    micro = [{"tokens": mine[i : i + 1]} for i in range(share)]
    total = BATCH * (SEQ - 1)

    def logp(batch, logits):
        return vocab_parallel_logprobs(
            logits[:, :-1], batch["tokens"][:, 1:], default_tp_group(), vocab_size=cfg.vocab_size
        )

    def loss_fn(batch, logits):
        nll = -logp(batch, logits).sum()
        return nll / total, {"nll_sum": nll.detach()}

    logps = model.forward(micro, logp)
    result = model.step(micro, loss_fn)
    metrics = {"grad_norm": result["grad_norm"], "nll_sum": sum(s["nll_sum"] for s in result["stats"])}
    return (torch.cat(logps).float().cpu() if logps else None), metrics


def greedy(engine, prompts):
    from aligner.generation import SamplingParams

    lengths = torch.full((prompts.shape[0],), prompts.shape[1], dtype=torch.long)
    return engine.generate(prompts, lengths, SamplingParams(greedy=True, ignore_eos=True))


def training_margins_and_logp(module, cfg, prompts, response):
    """Log-prob of `response` under the training forward per response slot, and the top-1 minus top-2 logit there
    (the margin is meaningful at TP=1 only: at TP>1 the logits are this rank's vocabulary shard)."""
    from aligner.models.gpt import forward
    from aligner.models.logprobs import default_tp_group, shift_for_next_token, vocab_parallel_logprobs

    seq = torch.cat([prompts.cuda(), response.cuda()], 1)
    with torch.no_grad():
        logits = forward(module, seq)
        shifted, targets = shift_for_next_token(logits, seq)
        logp = vocab_parallel_logprobs(shifted, targets, default_tp_group(), vocab_size=cfg.vocab_size)
        logp = logp[:, prompts.shape[1] - 1 :]
        top2 = logits[:, prompts.shape[1] - 1 : -1, : cfg.vocab_size].float().topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).cpu(), logp.float().cpu()


def run_ref(out_dir):
    from aligner.config import OptimConfig
    from aligner.generation import build_engine
    from aligner.models.sharding import full_state_dict
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(seed=3)
    cfg = model_cfg()
    tokens, prompts = data(cfg)
    model = TrainableModel(cfg, OptimConfig(lr=1e-5, clip_grad=0.0))
    full = {k: v.cpu() for k, v in full_state_dict(model.module, cfg).items()}
    torch.save(full, os.path.join(out_dir, "full.pt"))
    model.module.eval()
    engine = build_engine(gen_cfg(), cfg, model.module)
    out = greedy(engine, prompts)
    margins, train_logp = training_margins_and_logp(model.module, cfg, prompts, out.response_tokens_BR)
    del engine
    logp, metrics = train_once(model, cfg, tokens)
    grads = {k: v.float().cpu() for k, v in full_state_dict(model.module, cfg, grads=True).items()}
    floor = float((out.logprobs_BR.float().cpu() - train_logp).abs().mean())
    torch.save(
        {
            "engine_vs_training_logp_mean_abs": floor,
            "logp": logp,
            "nll_sum": float(metrics["nll_sum"]),
            "grad_norm": float(metrics["grad_norm"]),
            "grads": grads,
            "gen_tokens": out.response_tokens_BR.cpu(),
            "gen_logp": out.logprobs_BR.float().cpu(),
            "gen_margins": margins,
            "gen_train_logp": train_logp,
        },
        os.path.join(out_dir, "ref.pt"),
    )
    report = {
        "mode": "ref",
        "grad_norm": float(metrics["grad_norm"]),
        "nll_sum": float(metrics["nll_sum"]),
        "engine_vs_training_logp_mean_abs": floor,
        "median_greedy_margin": float(margins.median()),
    }
    return report


def compare_training(ref, logp, metrics, cfg, model):
    """Every rank gathers full grads; log-probs come from last-stage ranks, summed over data-parallel ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from aligner.models.sharding import full_state_dict

    grads = full_state_dict(model.module, cfg, grads=True)
    per_param = {k: rel(grads[k], ref["grads"][k]) for k in ref["grads"]}
    num = sum(float((grads[k].float() - ref["grads"][k].to(grads[k].device)).norm() ** 2) for k in ref["grads"])
    den = sum(float(ref["grads"][k].norm() ** 2) for k in ref["grads"])
    # Log-probs and nll: each data-parallel slice's last stage holds its share; gather them on every rank.
    last = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    share = BATCH // ps.get_data_parallel_world_size()
    mine = logp if (last and logp is not None) else torch.zeros(share, SEQ - 1)
    nll = torch.tensor([float(metrics["nll_sum"]) if last else 0.0], device="cuda")
    gathered = [torch.zeros(share, SEQ - 1, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine.cuda())
    flags = [torch.zeros(1, device="cuda") for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([1.0 if last else 0.0], device="cuda"))
    dist.all_reduce(nll)
    full_logp = torch.cat([g for g, f in zip(gathered, flags) if f.item() > 0]).cpu()
    d = (full_logp - ref["logp"]).abs()
    return {
        "logp_mean_abs": float(d.mean()),
        "logp_max_abs": float(d.max()),
        "nll_rel": abs(float(nll) - ref["nll_sum"]) / abs(ref["nll_sum"]),
        "grad_rel": (num / den) ** 0.5,
        "grad_rel_worst_param": max(per_param.values()),
        "worst_param": max(per_param, key=per_param.get),
        "grad_norm_rel": abs(float(metrics["grad_norm"]) - ref["grad_norm"]) / ref["grad_norm"],
    }


def engine_checks(ref, cfg, model, prompts):
    from aligner.generation import build_engine

    model.module.eval()
    engine = build_engine(gen_cfg(), cfg, model.module)
    out = greedy(engine, prompts)
    tokens, logp = out.response_tokens_BR.cpu(), out.logprobs_BR.float().cpu()
    same = (tokens == ref["gen_tokens"]).long().cumprod(1)
    common = same.sum(1)  # tokens before the first difference, per sample
    diffs, parted = [], []
    for b in range(tokens.shape[0]):
        n = int(common[b])
        # log-probs of the same tokens: the common prefix and the first differing slot's context is identical too
        diffs.append((logp[b, :n] - ref["gen_logp"][b, :n]).abs())
        if n < tokens.shape[1]:
            parted.append({"sample": b, "at": n, "ref_margin": float(ref["gen_margins"][b, n])})
    d = torch.cat(diffs)
    return engine, {
        "engine_logp_mean_abs": float(d.mean()) if d.numel() else 0.0,
        "engine_logp_max_abs": float(d.max()) if d.numel() else 0.0,
        "greedy_common_prefix_mean": float(common.float().mean()),
        "greedy_parted": parted,
        "median_ref_margin": float(ref["gen_margins"].median()),
    }


def refit_and_bench(engine, cfg, model, prompts):
    from aligner.generation import SamplingParams, build_engine

    ptrs = engine.buffer_data_ptrs()
    model.module.eval()
    engine.refit(model.module)  # the optimizer step has run: new weights
    out = greedy(engine, prompts)
    _, train_logp = training_margins_and_logp(model.module, cfg, prompts, out.response_tokens_BR)
    report = {
        "refit_pointers_unchanged": engine.buffer_data_ptrs() == ptrs,
        "refit_engine_vs_training_logp_mean_abs": float((out.logprobs_BR.float().cpu() - train_logp).abs().mean()),
    }
    del engine
    torch.cuda.empty_cache()
    B, P, N = (4, 8, 8) if TINY else (64, 128, 256)
    bench = build_engine(gen_cfg(B, P, N), cfg, model.module)
    prompts = torch.randint(0, cfg.vocab_size, (B, P), generator=torch.Generator().manual_seed(5))
    lengths = torch.full((B,), P, dtype=torch.long)
    sp = SamplingParams(greedy=True, ignore_eos=True)
    bench.generate(prompts, lengths, sp)
    sync()
    t0 = time.perf_counter()
    bench.generate(prompts, lengths, sp)
    sync()
    seconds = time.perf_counter() - t0
    t = bench.last_timings
    refit = []
    for _ in range(5):
        sync()
        t1 = time.perf_counter()
        bench.refit(model.module)
        sync()
        refit.append((time.perf_counter() - t1) * 1e3)
    report.update(
        {
            "bench_B": B,
            "bench_prompt": P,
            "bench_new": N,
            "bench_tok_s": B * N / seconds,
            "bench_decode_ms_per_step": t["decode_ms"] / max(1, t["decode_steps"]),
            "bench_prefill_ms": t["prefill_ms"],
            "bench_refit_ms": min(refit),
        }
    )
    return report


def run_parallel(mode, out_dir):
    import torch.distributed as dist

    from aligner.config import OptimConfig
    from aligner.models.sharding import load_full_state_dict
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    tp, pp = {"tp": (2, 1), "pp": (1, 2), "dp": (1, 1)}[mode]
    initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=3)
    cfg = model_cfg()
    tokens, prompts = data(cfg)
    ref = torch.load(os.path.join(out_dir, "ref.pt"), mmap=True)
    full = torch.load(os.path.join(out_dir, "full.pt"), mmap=True)
    # DP=2 compares gradients: with megatron's distributed optimizer each DP rank holds only its reduce-scattered
    # shard of them, so that run uses the plain optimizer (DDP all-reduces the full gradients).
    model = TrainableModel(cfg, OptimConfig(lr=1e-5, clip_grad=0.0, use_distributed_optimizer=mode != "dp"))
    load_full_state_dict(model.module, full, cfg)
    report = {
        "mode": mode,
        "world": dist.get_world_size(),
        "noise_floor_logp_mean_abs": ref["engine_vs_training_logp_mean_abs"],
    }
    engine = None
    if mode == "tp":
        engine, gen = engine_checks(ref, cfg, model, prompts)
        report.update(gen)
    logp, metrics = train_once(model, cfg, tokens)
    report.update(compare_training(ref, logp, metrics, cfg, model))
    if engine is not None:
        report.update(refit_and_bench(engine, cfg, model, prompts))
    return report


def verdict(report) -> str:
    checks = {k: report[k] <= v for k, v in TOL.items() if k in report}
    floor = report["noise_floor_logp_mean_abs"]
    # On CPU (float32) the floor can be 0: then allow float32 noise.
    checks.update({k: report[k] <= max(LOGP_FLOOR_FACTOR * floor, 1e-5) for k in LOGP_KEYS if k in report})
    if "refit_pointers_unchanged" in report:
        checks["refit_pointers_unchanged"] = report["refit_pointers_unchanged"]
    failed = [k for k, ok in checks.items() if not ok]
    report["checks"], report["failed"] = checks, failed
    return "PASS" if not failed else "FAIL " + ",".join(failed)


def main(mode, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    report = run_ref(out_dir) if mode == "ref" else run_parallel(mode, out_dir)
    rank = int(os.environ.get("RANK", "0"))
    report["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    line = verdict(report) if mode != "ref" else "REF"
    if rank == 0:
        with open(os.path.join(out_dir, f"{mode}.json"), "w") as f:
            json.dump(report, f, indent=1)
        brief = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in report.items() if k != "checks"}
        print(f"[{mode}] {line} {json.dumps(brief)}", flush=True)
    from aligner.parallel import shutdown

    shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "/tmp/parity")
