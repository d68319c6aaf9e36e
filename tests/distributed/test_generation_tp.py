"""The native engine at TP=2 (two gloo ranks) against megatron's TP=2 forward recomputed per token.

Both ranks load the same full weights (seeded, through `load_full_state_dict`), generate, and must agree with the
no-cache reference, with the training-side vocab-parallel log-probs, and with each other, token for token.
The vocabulary (250) is padded to 256, so rank 1's slice ends with padding columns the sampler must never draw.
"""

import torch
from dist import run_ranks

from aligner.config.schema import ModelConfig, OptimConfig
from aligner.generation import GenerationConfig, SamplingParams, build_engine

V = 250
LLAMA = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
)
GPT2 = ModelConfig(
    arch="gpt2",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=V,
    tie_embeddings=True,
    max_position_embeddings=64,
)
# Every feature the Llama 3.x and Qwen3 conversions bring, at once: llama3 RoPE scaling, tied embeddings, q/k norms,
# a head width (24) that is not hidden / heads
NEW = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
    tie_embeddings=True,
    head_dim=24,
    qk_layernorm=True,
    rope_scaling="llama3",
    rope_scaling_factor=5.0,
    rope_scaling_low_freq_factor=1.5,
    rope_scaling_high_freq_factor=6.0,
    rope_scaling_original_max_position_embeddings=48,
)
GEN = GenerationConfig(max_batch_size=4, max_prompt_length=8, max_response_length=10, kv_block=4, check_done_every=4)
PROMPTS = torch.randint(0, V, (3, 8), generator=torch.Generator().manual_seed(7))
LENGTHS = torch.tensor([2, 8, 5])


def _load_seeded_weights(module, cfg, seed=0):
    """Replace every parameter by seeded random values, identical on all ranks (full TP=1 tensors, then sharded)."""
    from aligner.models.sharding import full_state_dict, load_full_state_dict

    gen = torch.Generator().manual_seed(seed)
    full = {}
    for name, t in sorted(full_state_dict(module, cfg).items()):
        noise = torch.randn(t.shape, generator=gen)
        full[name] = 1.0 + 0.1 * noise if "layernorm" in name else 0.2 * noise
    load_full_state_dict(module, full, cfg)


def _responses(out):
    return [out.response_tokens_BR[b, : int(n)].tolist() for b, n in enumerate(out.response_lengths_B)]


def _tp2_body(rank, world_size):
    from generation_reference import reference_greedy, training_logprobs

    from aligner.generation.native.replay import fake_fp8, fp8_kv_cache
    from aligner.models.gpt import build_gpt
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(2, 1)
    seen = {}
    for name, cfg in (("llama", LLAMA), ("gpt2", GPT2), ("llama3_qwen3", NEW)):
        model = build_gpt(cfg)
        _load_seeded_weights(model, cfg)
        model.eval()
        engine = build_engine(GEN, cfg, model)
        out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        assert _responses(out) == reference_greedy(model, PROMPTS, LENGTHS, 10, V), name
        ref = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, 1.0, V)
        torch.testing.assert_close(out.logprobs_BR, ref, rtol=0, atol=2e-5)
        sampled = engine.generate(PROMPTS, LENGTHS, SamplingParams(temperature=0.8, top_p=0.95, seeds=[1, 2, 3]))
        assert (sampled.response_tokens_BR < V).all()
        ref = training_logprobs(model, PROMPTS, LENGTHS, sampled.response_tokens_BR, sampled.response_lengths_B, 0.8, V)
        torch.testing.assert_close(sampled.logprobs_BR, ref, rtol=0, atol=2e-5)
        unseeded = engine.generate(PROMPTS, LENGTHS, SamplingParams())  # base seed drawn, then shared by TP rank 0
        seen[name] = [_responses(out), _responses(sampled), _responses(unseeded)]
        # the Triton decode attention on each rank's KV groups (Triton's interpreter); Llama: RoPE inside the kernel
        if name in ("llama", "llama3_qwen3"):
            triton = build_engine(GenerationConfig(**{**GEN.__dict__, "decode_attention": "triton"}), cfg, model)
            again = triton.generate(PROMPTS, LENGTHS, SamplingParams(temperature=0.8, top_p=0.95, seeds=[1, 2, 3]))
            assert _responses(again) == _responses(sampled)
            torch.testing.assert_close(again.logprobs_BR, sampled.logprobs_BR, rtol=0, atol=2e-5)
            # an FP8 KV cache: each rank quantizes its own KV groups (the scale is per slot and group, so the
            # sharding changes nothing), against megatron's TP=2 forward attending to the same quantized values
            fp8kv = GenerationConfig(**{**GEN.__dict__, "decode_attention": "triton", "kv_dtype": "fp8"})
            fp8_engine = build_engine(fp8kv, cfg, model)
            assert fp8_engine.decoder.kv.dtype == torch.float8_e4m3fn
            q = fp8_engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
            with fp8_kv_cache(model):
                assert _responses(q) == reference_greedy(model, PROMPTS, LENGTHS, 10, V), name
                ref = training_logprobs(model, PROMPTS, LENGTHS, q.response_tokens_BR, q.response_lengths_B, 1.0, V)
            torch.testing.assert_close(q.logprobs_BR, ref, rtol=0, atol=2e-5)
            plain = training_logprobs(model, PROMPTS, LENGTHS, q.response_tokens_BR, q.response_lengths_B, 1.0, V)
            assert (q.logprobs_BR - plain).abs().max() > 1e-4, "the quantization must matter"
            seen[f"{name}_fp8kv"] = _responses(q)
        if name == "gpt2":  # FP8 decode weights: each rank's fc2 partial sum dequantized before the all-reduce
            fp8 = build_engine(GenerationConfig(**{**GEN.__dict__, "decode_weights": "fp8"}), cfg, model)
            q = fp8.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
            with fake_fp8(model, LENGTHS, int((LENGTHS + q.response_lengths_B).max())):
                ref = training_logprobs(model, PROMPTS, LENGTHS, q.response_tokens_BR, q.response_lengths_B, 1.0, V)
            valid = torch.arange(ref.shape[1])[None] < q.response_lengths_B[:, None]
            assert (q.logprobs_BR - ref).abs()[valid].max() < 2e-3
            seen["fp8"] = _responses(q)

    # refit after an optimizer step, at TP=2
    trainable = TrainableModel(LLAMA, OptimConfig(lr=3e-2, clip_grad=0.0))
    _load_seeded_weights(trainable.module, LLAMA, seed=1)
    trainable.module.eval()
    engine = build_engine(GEN, LLAMA, trainable.module)
    ptrs = engine.buffer_data_ptrs()
    before = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
    trainable.step([{"tokens": tokens}], lambda batch, logits: (logits.float().logsumexp(-1).mean(), {}))
    trainable.module.eval()
    engine.refit(trainable.module)
    assert engine.buffer_data_ptrs() == ptrs
    after = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    assert _responses(after) == reference_greedy(trainable.module, PROMPTS, LENGTHS, 10, V)
    ref = training_logprobs(
        trainable.module, PROMPTS, LENGTHS, after.response_tokens_BR, after.response_lengths_B, 1.0, V
    )
    torch.testing.assert_close(after.logprobs_BR, ref, rtol=0, atol=2e-5)
    assert (after.logprobs_BR - before.logprobs_BR).abs().max() > 1e-3, "the step must have changed the policy"
    seen["refit"] = _responses(after)
    return seen


def test_tp2_greedy_logprobs_refit_and_rank_agreement():
    per_rank = run_ranks(_tp2_body, 2)
    assert per_rank[0] == per_rank[1], "TP ranks must draw identical tokens"


# -- PP=2: every rank of the pipeline group holds all layers (gathered at build and refit) and generates ----------

LLAMA4 = ModelConfig(
    arch="llama",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
)
GPT2_4 = ModelConfig(
    arch="gpt2",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=V,
    tie_embeddings=True,
    max_position_embeddings=64,
)


def _pp_body(rank, world_size, pp):
    """Greedy and seeded sampling before and after one optimizer step, per model; the engine's buffer pointers."""
    import torch.distributed as dist

    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(1, pp)
    seen = {}
    for name, cfg in (("llama", LLAMA4), ("gpt2", GPT2_4)):
        trainable = TrainableModel(cfg, OptimConfig(lr=3e-2, clip_grad=0.0))
        _load_seeded_weights(trainable.module, cfg, seed=2)
        trainable.module.eval()
        engine = build_engine(GEN, cfg, trainable.module)
        ptrs = engine.buffer_data_ptrs()
        greedy = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        sampled = engine.generate(PROMPTS, LENGTHS, SamplingParams(temperature=0.8, top_p=0.95, seeds=[1, 2, 3]))
        unseeded = engine.generate(PROMPTS, LENGTHS, SamplingParams())  # base seed shared over the PP group too
        tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
        trainable.step([{"tokens": tokens}], lambda batch, logits: (logits.float().logsumexp(-1).mean(), {}))
        trainable.module.eval()
        engine.refit(trainable.module)
        after = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        seen[name] = {
            "tokens": [_responses(o) for o in (greedy, sampled, after)],
            "unseeded": _responses(unseeded),
            "logp": [o.logprobs_BR for o in (greedy, sampled, after)],
            "same_ptrs": engine.buffer_data_ptrs() == ptrs,
            "layers": engine.weights.num_layers,
            "changed": float((after.logprobs_BR - greedy.logprobs_BR).abs().max()),
        }
    seen["rank"] = dist.get_rank()
    return seen


def test_pp2_engine_gathers_layers_and_matches_pp1():
    (one,) = run_ranks(_pp_body, 1, 1)
    two = run_ranks(_pp_body, 2, 2)
    for name in ("llama", "gpt2"):
        assert one[name]["changed"] > 1e-3, "the step must have changed the policy"
        assert two[0][name]["unseeded"] == two[1][name]["unseeded"], "PP ranks must draw identical tokens"
        for r in two:
            assert r[name]["layers"] == 4, "each PP rank's engine holds all layers"
            assert r[name]["same_ptrs"], "refit must not reallocate"
            assert r[name]["tokens"] == one[name]["tokens"], (name, r["rank"])
            for got, want in zip(r[name]["logp"], one[name]["logp"]):
                torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
