"""The native engine at TP=1 on CPU against megatron's own forward recomputed per token (no cache).

Tiny models (2 layers, hidden 64, GQA with 2 KV groups, vocabulary 250 padded to 256), prompts of different lengths,
kv_block=4 so the decode attention length changes bucket several times within one call.
"""

import contextlib
from dataclasses import replace

import pytest
import torch
from generation_reference import reference_greedy, training_logprobs

from aligner.config.schema import ModelConfig, OptimConfig
from aligner.families import family
from aligner.generation import GenerationConfig, ReleasableMemory, SamplingParams, build_engine
from aligner.generation.native.replay import fp8_kv_cache
from aligner.models.gpt import build_gpt

V = 250
LLAMA = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
    init_method_std=0.2,
    add_qkv_bias=True,
)
GPT2 = ModelConfig(
    arch="gpt2",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=V,
    init_method_std=0.2,
    tie_embeddings=True,
    max_position_embeddings=64,
)
# Llama 3.2-style: llama3 RoPE scaling (numbers that put the 8 frequencies in all three bands) and tied embeddings
LLAMA3 = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
    init_method_std=0.2,
    tie_embeddings=True,
    rope_scaling="llama3",
    rope_scaling_factor=5.0,
    rope_scaling_low_freq_factor=1.5,
    rope_scaling_high_freq_factor=6.0,
    rope_scaling_original_max_position_embeddings=48,
)
# Qwen3-style: per-head q/k RMSNorm, a head width (24) that is not hidden / heads (16), a large RoPE base
QWEN3 = ModelConfig(
    arch="llama",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=V,
    init_method_std=0.2,
    head_dim=24,
    qk_layernorm=True,
    rotary_base=1e6,
)
# Phi-4-mini-style: LongRoPE over 3/4 of each head (12 of 16 channels, 6 frequencies), its attention factor on the
# scale and on the passed channels (aligner.models.rope.passed_channel_scale)
PHI4MINI = replace(
    LLAMA,
    arch="phi3",
    add_qkv_bias=False,
    rotary_percent=0.75,
    rope_scaling="longrope",
    rope_scaling_short_factor=[1.0, 1.5, 2.5, 4.0, 7.0, 11.0],
    rope_scaling_long_factor=[4.0] * 6,
    rope_scaling_original_max_position_embeddings=2048,
    rope_scaling_attention_factor=1.25,
)
# SmolLM3-style: the second layer attends without RoPE (the engine's identity tables there)
SMOLLM3 = replace(LLAMA, nope_layers=[1])
GEN = GenerationConfig(max_batch_size=5, max_prompt_length=10, max_response_length=12, kv_block=4, check_done_every=3)
PROMPTS = torch.randint(0, V, (4, 10), generator=torch.Generator().manual_seed(5))
LENGTHS = torch.tensor([3, 10, 1, 6])


@pytest.fixture(scope="module", autouse=True)
def megatron_tp1():
    from dist import free_port

    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())


def _model(cfg, seed=0):
    torch.manual_seed(seed)
    model = build_gpt(cfg)
    if cfg.qk_layernorm:  # built as ones: make every norm weight count, so a norm applied wrongly shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.2 * torch.randn(p.shape))
    model.eval()
    return model


def _padded_prompts():
    prompts = PROMPTS.clone()
    prompts[torch.arange(10)[None] >= LENGTHS[:, None]] = -100  # padding must never be read
    return prompts


def _responses(out):
    return [out.response_tokens_BR[b, : int(n)].tolist() for b, n in enumerate(out.response_lengths_B)]


@pytest.mark.parametrize(
    "cfg,attention",
    [
        (LLAMA, "matmul"),
        (LLAMA, "sdpa"),
        (GPT2, "matmul"),
        (LLAMA3, "matmul"),
        (QWEN3, "matmul"),
        (QWEN3, "sdpa"),
        (LLAMA, "triton"),
        (GPT2, "triton"),
        (GPT2, "triton-scatter"),
        (QWEN3, "triton"),
        (LLAMA, "triton-splitk"),
        (GPT2, "matmul-splitk"),
        (LLAMA, "triton-fp8kv"),
        (QWEN3, "triton-fp8kv"),
        (GPT2, "triton-fp8kv"),
        (PHI4MINI, "matmul"),
        (PHI4MINI, "triton"),
        (PHI4MINI, "triton-fp8kv"),
        (SMOLLM3, "matmul"),
        (SMOLLM3, "triton-fp8kv"),
    ],
    ids=[
        "llama-matmul",
        "llama-sdpa",
        "gpt2",
        "llama3-matmul",
        "qwen3-matmul",
        "qwen3-sdpa",
        "llama-triton",
        "gpt2-triton",
        "gpt2-triton-scatter",
        "qwen3-triton",
        "llama-triton-splitk",  # split-K proj (fc2's 96 columns: cuBLAS), fc1 + SwiGLU in one kernel; interpreted
        "gpt2-matmul-splitk",  # for proj and fc2, with their row biases
        "llama-triton-fp8kv",  # an FP8 KV cache (generation.kv_dtype): RoPE and the cache writes by the kernel
        "qwen3-triton-fp8kv",  # ... the step's key and value from the q/k-norm RoPE kernel, quantized by the kernel
        "gpt2-triton-fp8kv",  # ... learned positions: no RoPE, the kernel quantizes and writes the projection's rows
        "phi4mini-matmul",  # part of each head rotated, the rest passed through scaled
        "phi4mini-triton",  # ... by the kernel's RoPE
        "phi4mini-triton-fp8kv",
        "smollm3-matmul",  # RoPE left out of one layer: prefill's and decode's compiled RoPE on identity tables
        "smollm3-triton-fp8kv",  # ... the kernel's RoPE on them
    ],
)
def test_greedy_equals_no_cache_reference(cfg, attention, monkeypatch):
    gemm, kv_dtype = "cublas", "auto"
    if attention.endswith("-fp8kv"):  # the reference: megatron attending to the FP8 cache's values (fp8_kv_cache)
        attention, kv_dtype = attention.removesuffix("-fp8kv"), "fp8"
    if attention.endswith("-splitk"):  # decode's proj/fc2 by the split-K Triton kernel (generation.decode_gemm)
        attention, gemm = attention.removesuffix("-splitk"), "splitk"
        pytest.importorskip("triton")
    if attention.startswith("triton"):  # the Triton kernel itself, run by Triton's interpreter (tests/conftest.py)
        pytest.importorskip("triton")
    if attention == "triton-scatter":  # the cache written by a scatter (large batches), not by the kernel
        from aligner.generation.native import triton_decode

        monkeypatch.setattr(triton_decode, "FUSED_WRITE_MAX_BATCH", 0)
        attention = "triton"
    model = _model(cfg)
    gen = GenerationConfig(**{**GEN.__dict__, "decode_attention": attention, "decode_gemm": gemm, "kv_dtype": kv_dtype})
    engine = build_engine(gen, cfg, model)
    assert engine.decode_gemm == gemm
    assert engine.decoder.kv.dtype == (torch.float8_e4m3fn if kv_dtype == "fp8" else torch.float32)
    # Qwen3's q/k norms by the Triton kernel itself, before its RoPE (triton_decode.QK_NORM)
    assert engine.decoder._qk_norm_in_kernel() == (cfg.qk_layernorm and attention == "triton")
    if gemm == "splitk":  # count the kernel's calls (the real kernel runs): proj, and fc2 where its sizes fit
        from aligner.generation.native import splitk

        calls, real = [], splitk.matmul
        monkeypatch.setattr(splitk, "matmul", lambda *a: calls.append(a[1].shape) or real(*a))
        gated, real_gated = [], splitk.gated_matmul  # and a SwiGLU MLP's fc1 with its activation (Llama)
        monkeypatch.setattr(splitk, "gated_matmul", lambda *a: gated.append(a[1].shape) or real_gated(*a))
    if family(cfg.arch).rope:  # the engine rotates with the model's own (possibly scaled) frequencies
        angles = torch.outer(
            torch.arange(GEN.max_prompt_length + GEN.max_response_length).float(), model.rotary_pos_emb.inv_freq
        )
        assert torch.equal(engine.decoder.cos[:, : angles.shape[1]], torch.cos(angles))
    out = engine.generate(_padded_prompts(), LENGTHS, SamplingParams(greedy=True))
    if gemm == "splitk":  # 11 decode steps (the first token comes from prefill) x 2 layers
        assert len(calls) == 11 * 2 * (2 if cfg.arch == "gpt2" else 1)
        assert len(gated) == (0 if cfg.arch == "gpt2" else 11 * 2)
    with fp8_kv_cache(model) if kv_dtype == "fp8" else contextlib.nullcontext():
        expected = reference_greedy(model, PROMPTS, LENGTHS, 12, V)
        ref_logp = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, 1.0, V)
    assert _responses(out) == expected
    assert out.response_tokens_BR.shape == (4, 12) and out.response_lengths_B.tolist() == [12] * 4
    assert not out.ended_B.any()
    torch.testing.assert_close(out.logprobs_BR, ref_logp, rtol=0, atol=2e-5)
    if kv_dtype == "fp8":  # the quantization is real: megatron's forward without it differs
        plain = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, 1.0, V)
        assert (plain - ref_logp).abs().max() > 1e-3
        # the scales are released and re-taken with the cache (generation.release_kv_cache), and graphs address them
        assert "kv_scale" in engine.buffer_data_ptrs()
        engine.release_memory()
        assert engine.decoder.kv is None and engine.decoder.kv_scale is None
        engine.acquire_memory()
        again = engine.generate(_padded_prompts(), LENGTHS, SamplingParams(greedy=True, max_new_tokens=4))
        assert torch.equal(again.response_tokens_BR, out.response_tokens_BR[:, :4])  # (interpreted: 4 tokens)


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_compiled_elementwise_kernels_match_the_reference(cfg):
    """The torch.compile'd norms/RoPE/activations (what GPUs with Triton run; Qwen3: with the q/k norms); on CPU
    inductor needs a C++ compiler."""
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    model = _model(cfg)
    engine = build_engine(GenerationConfig(**{**GEN.__dict__, "compile_elementwise": "on"}), cfg, model)
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True, max_new_tokens=6))
    assert _responses(out) == reference_greedy(model, PROMPTS, LENGTHS, 6, V)
    ref = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, 1.0, V)
    torch.testing.assert_close(out.logprobs_BR, ref, rtol=0, atol=2e-5)


def test_sampled_logprobs_equal_training_logprobs_at_temperature():
    model = _model(LLAMA)
    engine = build_engine(GEN, LLAMA, model)
    for sp in (SamplingParams(temperature=0.7, seed=3), SamplingParams(temperature=1.3, top_k=20, top_p=0.9, seed=4)):
        out = engine.generate(PROMPTS, LENGTHS, sp)
        ref = training_logprobs(
            model, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, sp.temperature, V
        )
        torch.testing.assert_close(out.logprobs_BR, ref, rtol=0, atol=2e-5)
        assert (out.logprobs_BR < 0).all()


def test_eos_stop_tokens_min_new_and_length_limit():
    model = _model(LLAMA)
    engine = build_engine(GEN, LLAMA, model)
    free = _responses(engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True)))
    eos, stop = free[0][2], free[1][4]  # tokens greedy decoding reaches: samples 0 and 1 must end there (or before)
    cases = [
        {"eos_token_id": eos, "stop_token_ids": [stop]},
        {"eos_token_id": eos, "stop_token_ids": [stop], "min_new_tokens": 5},
        {"eos_token_id": [eos, stop], "max_new_tokens": 7},
    ]
    for case in cases:
        sp = SamplingParams(greedy=True, pad_token_id=V - 1, **case)
        out = engine.generate(PROMPTS, LENGTHS, sp)
        n = case.get("max_new_tokens", 12)
        expected = reference_greedy(
            model, PROMPTS, LENGTHS, n, V, end_ids=sp.end_token_ids(), min_new=case.get("min_new_tokens", 0)
        )
        assert _responses(out) == expected, case
        ended = [r[-1] in sp.end_token_ids() and len(r) > case.get("min_new_tokens", 0) for r in expected]
        assert out.ended_B.tolist() == ended
        min_new = case.get("min_new_tokens", 0)
        if min_new:
            assert expected[0][:2] == free[0][:2] and expected[0][2] != eos, "EOS at step 2 must have been banned"
            assert all(t not in (eos, stop) for r in expected for t in r[:min_new])
        else:
            assert out.ended_B[:2].all(), "samples 0 and 1 were built to hit an ending token"
        assert out.response_tokens_BR.shape[1] == max(len(r) for r in expected)
        for b, r in enumerate(expected):
            assert (out.response_tokens_BR[b, len(r) :] == V - 1).all(), "after the end: pad tokens"
            assert (out.logprobs_BR[b, len(r) :] == 0).all(), "after the end: zero log-probs"
            if not ended[b]:
                assert len(r) == n, "a sample that did not end is cut at max_new_tokens"
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True, eos_token_id=eos, ignore_eos=True))
    assert out.response_lengths_B.tolist() == [12] * 4 and not out.ended_B.any()


def test_triton_token_choice_records_what_torch_records(monkeypatch):
    """generation.token_choice=triton (choice.py's two kernels; Triton's interpreter here): the same tokens, lengths,
    ends and log-probs as torch's function, for greedy choice with an end token banned before min_new_tokens and for
    plain sampling; a top-k step keeps torch's function. Refused with the reason where the kernels cannot run; auto
    takes torch's function on the CPU."""
    pytest.importorskip("triton")
    from aligner.generation.native import choice

    model = _model(LLAMA)
    plain = build_engine(GEN, LLAMA, model)
    assert plain.token_choice == "torch"
    engine = build_engine(GenerationConfig(**{**GEN.__dict__, "token_choice": "triton"}), LLAMA, model)
    assert engine.token_choice == "triton"
    calls, real = [], choice.choose_and_record
    monkeypatch.setattr(choice, "choose_and_record", lambda *a, **k: calls.append(k["greedy"]) or real(*a, **k))
    eos = _responses(plain.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True)))[0][2]
    cases = [
        SamplingParams(greedy=True, eos_token_id=eos, min_new_tokens=3, pad_token_id=V - 1),
        SamplingParams(greedy=True, eos_token_id=eos, pad_token_id=V - 1),
        SamplingParams(temperature=0.7, seeds=[1, 2, 3, 4], eos_token_id=eos),
        SamplingParams(temperature=1.3, top_k=20, seed=4),
    ]
    for sp in cases:
        before = len(calls)
        want, got = plain.generate(PROMPTS, LENGTHS, sp), engine.generate(PROMPTS, LENGTHS, sp)
        assert torch.equal(got.response_tokens_BR, want.response_tokens_BR), sp
        assert torch.equal(got.response_lengths_B, want.response_lengths_B) and torch.equal(got.ended_B, want.ended_B)
        torch.testing.assert_close(got.logprobs_BR, want.logprobs_BR, rtol=0, atol=2e-5)
        assert (len(calls) > before) == (sp.top_k == 0), "the kernels run for greedy and plain sampling only"
        if sp is cases[1]:
            assert got.ended_B[0] and got.response_lengths_B[0] == 3, "sample 0 reaches the end token at step 2"
    assert True in calls and False in calls
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"generation.token_choice=triton is not possible here: (it needs|Tri)"):
        build_engine(GenerationConfig(**{**GEN.__dict__, "token_choice": "triton"}), LLAMA, model)


def test_seeds_make_samples_independent_of_batch_composition():
    model = _model(LLAMA)
    engine = build_engine(GEN, LLAMA, model)
    sp = {"temperature": 1.0, "max_new_tokens": 10}
    full = engine.generate(PROMPTS, LENGTHS, SamplingParams(seeds=[11, 12, 13, 14], **sp))
    again = engine.generate(PROMPTS, LENGTHS, SamplingParams(seeds=[11, 12, 13, 14], **sp))
    assert torch.equal(full.response_tokens_BR, again.response_tokens_BR)
    # the same (prompt, seed) pairs in another order and with another neighbour
    order = [3, 1, 0]
    prompts = torch.cat([PROMPTS[order], PROMPTS[2:3]])
    lengths = torch.cat([LENGTHS[order], LENGTHS[2:3]])
    mixed = engine.generate(prompts, lengths, SamplingParams(seeds=[14, 12, 11, 99], **sp))
    for i, b in enumerate(order):
        n = int(full.response_lengths_B[b])
        assert mixed.response_tokens_BR[i, :n].tolist() == full.response_tokens_BR[b, :n].tolist()
    other = engine.generate(PROMPTS, LENGTHS, SamplingParams(seeds=[21, 22, 23, 24], **sp))
    assert not torch.equal(other.response_tokens_BR, full.response_tokens_BR)
    # a base seed is seed + row
    based = engine.generate(PROMPTS, LENGTHS, SamplingParams(seed=11, **sp))
    assert torch.equal(based.response_tokens_BR, full.response_tokens_BR)


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "triton-fp8kv"])
def test_repeated_prompts_are_prefilled_once(attention, monkeypatch):
    """generation.prefill_repeats_once: a prompt repeated in neighbouring rows (a group's samples) is prefilled once
    and its rows copy the cache slots and first logits; every sample then draws its own tokens, as when each row is
    prefilled (the same seeds: the same tokens, log-probs within float32 rounding). Rows that repeat a prompt further
    up but not their neighbour's, or only its first tokens, are prefilled themselves. Each cache layout: matmul's,
    sdpa's (slot-major; the Triton kernel's 16-bit cache is matmul's), the FP8 cache (values in chunks, a scale per
    slot)."""
    kv_dtype = "auto"
    if attention == "triton-fp8kv":  # the Triton kernel under Triton's interpreter
        pytest.importorskip("triton")
        attention, kv_dtype = "triton", "fp8"
    model = _model(LLAMA)
    gen = replace(GEN, max_batch_size=8, decode_attention=attention, kv_dtype=kv_dtype)
    once = build_engine(gen, LLAMA, model)
    each = build_engine(replace(gen, prefill_repeats_once=False), LLAMA, model)
    # rows: A A A B C C A B' (B' = B's first 4 tokens; A again, but below C)
    order = [0, 0, 0, 1, 3, 3, 0, 1]
    prompts, lengths = _padded_prompts()[order], LENGTHS[order].clone()
    lengths[7] = 4
    prefilled = []
    real = once.decoder.prefill
    monkeypatch.setattr(once.decoder, "prefill", lambda t, *a, **kw: prefilled.append(t.shape[0]) or real(t, *a, **kw))
    calls = (SamplingParams(seeds=list(range(30, 38))), SamplingParams(seed=7, top_k=20), SamplingParams(greedy=True))
    if kv_dtype == "fp8":  # under Triton's interpreter (a minute a call): the FP8 cache's slots copied, one call
        calls = calls[:1]
    for sp in calls:
        a, b = once.generate(prompts, lengths, sp), each.generate(prompts, lengths, sp)
        assert once.last_timings["prefill_prompts"] == 5 and each.last_timings["prefill_prompts"] == 8
        assert torch.equal(a.response_tokens_BR, b.response_tokens_BR) and torch.equal(a.ended_B, b.ended_B)
        torch.testing.assert_close(a.logprobs_BR, b.logprobs_BR, rtol=0, atol=1e-5)
        if not sp.greedy:  # the group's samples differ from one another
            assert len({tuple(r) for r in a.response_tokens_BR[:3].tolist()}) > 1
    assert prefilled == [5] * len(calls)
    if kv_dtype == "auto":
        greedy = [row[: int(n)] for row, n in zip(a.response_tokens_BR.tolist(), a.response_lengths_B)]
        assert greedy == reference_greedy(model, prompts.clamp(min=0), lengths, 12, V)


@pytest.mark.parametrize("group_prefix", [False, True], ids=["rows", "group_programs"])
@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_shared_prefix_reads_a_groups_prompt_from_its_first_row(kv_dtype, group_prefix, monkeypatch):
    """triton_decode.SHARED_PREFIX: the Triton kernel reads a repeated prompt's whole steps from the group's first row
    (decode steps of 16 slots here, prompts of 20-36 tokens); with GROUP_PREFIX (from GROUP_PREFIX_MIN_BATCH rows,
    here 2) a group program attends them for a chunk of the group's rows (the model's 2 query heads a KV group:
    chunks of up to 8 rows; here rows 0-2 and 3-4), not below that many rows;
    the samples are those of the engine that prefills every row (same seeds: same tokens, log-probs within float32
    rounding), and the kernel got each row's lead. Calls without repeated prompts, or with SHARED_PREFIX off, pass
    the kernel no leads (its plain form)."""
    pytest.importorskip("triton")
    from aligner.generation.native import triton_decode

    monkeypatch.setattr(triton_decode, "BLOCK_N", 16)
    monkeypatch.setattr(triton_decode, "SHARED_PREFIX", True)
    monkeypatch.setattr(triton_decode, "GROUP_PREFIX", group_prefix)
    monkeypatch.setattr(triton_decode, "GROUP_PREFIX_MIN_BATCH", 2)
    model = _model(LLAMA)
    gen = replace(
        GEN, max_batch_size=6, max_prompt_length=36, max_response_length=6, decode_attention="triton", kv_dtype=kv_dtype
    )
    once = build_engine(gen, LLAMA, model)
    each = build_engine(replace(gen, prefill_repeats_once=False), LLAMA, model)
    prompts = torch.randint(0, V, (6, 36), generator=torch.Generator().manual_seed(3))
    prompts[1:3], prompts[4] = prompts[0], prompts[3]  # groups: rows 0-2 (36 tokens), 3-4 (20), 5 alone (29)
    lengths = torch.tensor([36, 36, 36, 20, 20, 29])
    leads, chunks = [], []
    real = triton_decode.decode_attention

    def attention(*a, shared=None, groups=None, **kw):
        leads.append(shared and shared[0].tolist())
        chunks.append(groups and (groups[0].tolist(), groups[1].tolist()))
        return real(*a, shared=shared, groups=groups, **kw)

    monkeypatch.setattr(triton_decode, "decode_attention", attention)
    sp = SamplingParams(seeds=list(range(40, 46)), max_new_tokens=4)
    a = once.generate(prompts, lengths, sp)
    assert leads[-1] == [0, 0, 0, 3, 3, 5] and once.decoder.shared_B[:6].tolist() == lengths.tolist()
    if group_prefix:
        assert chunks[-1] == ([36, 36, 36, 20, 20, -1], [[0, 3, 36], [3, 2, 20], [0, 0, 0]])
    else:
        assert chunks[-1] is None
    b = each.generate(prompts, lengths, sp)
    assert leads[-1] is None and chunks[-1] is None  # every row prefilled: no group
    assert torch.equal(a.response_tokens_BR, b.response_tokens_BR)
    torch.testing.assert_close(a.logprobs_BR, b.logprobs_BR, rtol=0, atol=1e-5)
    if group_prefix:  # fewer rows than GROUP_PREFIX_MIN_BATCH: the rows' programs only
        monkeypatch.setattr(triton_decode, "GROUP_PREFIX_MIN_BATCH", 7)
        d = once.generate(prompts, lengths, sp)
        assert leads[-1] == [0, 0, 0, 3, 3, 5] and chunks[-1] is None
        assert torch.equal(a.response_tokens_BR, d.response_tokens_BR)
    monkeypatch.setattr(triton_decode, "SHARED_PREFIX", False)
    c = once.generate(prompts, lengths, sp)
    assert leads[-1] is None and torch.equal(a.response_tokens_BR, c.response_tokens_BR)


def test_vocabulary_padding_is_never_sampled():
    model = _model(LLAMA)
    engine = build_engine(GEN, LLAMA, model)
    assert engine.weights.get("output_layer.weight").shape[0] == 256
    with torch.no_grad():
        engine.weights.get("output_layer.weight")[V:] = 50.0  # padding rows with overwhelming logits
    for sp in (SamplingParams(greedy=True), SamplingParams(seed=1), SamplingParams(seed=2, top_k=300)):
        out = engine.generate(PROMPTS, LENGTHS, sp)
        assert (out.response_tokens_BR < V).all() and torch.isfinite(out.logprobs_BR).all()
        expected = reference_greedy(model, PROMPTS, LENGTHS, 12, V) if sp.greedy else None
        if expected:
            assert _responses(out) == expected


class _EagerCapturer:
    """Stands in for CudaGraphCapturer on CPU: the same warm-up steps (which scribble on the engine's state, as the
    real ones do), then the step itself as its "replay". Checks the graph bookkeeping: keys cover every step, state is
    reset after capture, graphs are reused across calls."""

    def __init__(self):
        self.captured = 0

    def capture(self, step):
        self.captured += 1
        step()
        step()
        return step


def test_graph_mode_bookkeeping_matches_eager():
    model = _model(LLAMA)
    eager = build_engine(GEN, LLAMA, model)
    graphed = build_engine(GEN, LLAMA, model)
    graphed.use_graphs, graphed._capturer = True, _EagerCapturer()
    calls = [
        (PROMPTS, LENGTHS, SamplingParams(greedy=True)),
        (PROMPTS, LENGTHS, SamplingParams(seed=5, top_k=30, top_p=0.9, eos_token_id=int(PROMPTS[0, 0]))),
        (PROMPTS[:2], LENGTHS[:2], SamplingParams(greedy=True, max_new_tokens=5)),
        (PROMPTS, LENGTHS, SamplingParams(greedy=True)),
    ]
    for prompts, lengths, sp in calls:
        a, b = eager.generate(prompts, lengths, sp), graphed.generate(prompts, lengths, sp)
        assert torch.equal(a.response_tokens_BR, b.response_tokens_BR) and torch.equal(a.ended_B, b.ended_B)
        torch.testing.assert_close(a.logprobs_BR, b.logprobs_BR, rtol=0, atol=0)
    # longest prompt 10 + decode steps 1..11 attend over 11..21 slots -> buckets 12, 16, 20, 24 per sampling mode;
    # the B=2 call (5 new tokens) needs 12 and 16; the last call reuses the first call's graphs; prefill: one graph
    # for 4 rows and one for 2, both 10 wide (64 capped at max_prompt_length)
    assert graphed.num_graphs == 4 + 4 + 2 and sorted(graphed._prefill_graphs) == [(2, 10, 0), (4, 10, 0)]
    assert graphed._capturer.captured == graphed.num_graphs + 2


def test_prefill_graphs_pad_the_width_and_chunk_the_rows(monkeypatch):
    """Prefill graphs (generation.prefill_graph_max_tokens): the prompts' width rounded up (here to a multiple of 4:
    6 -> 8 columns, padding after every prompt), one graph per row chunk (prefill_max_tokens=12: 2 rows of 6), each
    reused by the next call; the tokens those of the eager engine, the log-probs too up to float32 rounding (the
    wider GEMMs and attention round differently). Chunks above the limit are prefilled without a graph."""
    from aligner.generation.native import engine as engine_mod

    monkeypatch.setattr(engine_mod, "PREFILL_WIDTH_STEP", 4)
    model = _model(LLAMA)
    lengths = torch.tensor([3, 6, 1, 5])
    gen = replace(GEN, prefill_max_tokens=12)
    eager = build_engine(gen, LLAMA, model)
    graphed = build_engine(gen, LLAMA, model)
    graphed.use_graphs, graphed._capturer = True, _EagerCapturer()
    widths = []
    real_prefill = graphed.decoder.prefill
    monkeypatch.setattr(
        graphed.decoder, "prefill", lambda t, *a, **kw: widths.append(t.shape) or real_prefill(t, *a, **kw)
    )
    for sp in (SamplingParams(greedy=True), SamplingParams(seed=3)):
        a, b = eager.generate(PROMPTS, lengths, sp), graphed.generate(PROMPTS, lengths, sp)
        assert torch.equal(a.response_tokens_BR, b.response_tokens_BR)
        torch.testing.assert_close(a.logprobs_BR, b.logprobs_BR, rtol=0, atol=1e-5)
    assert sorted(graphed._prefill_graphs) == [(2, 8, 0), (2, 8, 2)]
    # two chunks, each captured once (the stand-in's two calls) and replayed in the first generate, replayed in the
    # second
    assert set(widths) == {torch.Size([2, 8])} and len(widths) == 2 * (2 + 1) + 2
    want = eager.generate(PROMPTS, lengths, SamplingParams(greedy=True)).response_tokens_BR
    # 2 x 8 = 16 tokens above the limit; release_kv_cache (the graphs would hold their activations' memory); TP > 1
    for off in (dict(prefill_graph_max_tokens=15), dict(release_kv_cache=True), dict(tp=2)):
        above = build_engine(replace(gen, **{k: v for k, v in off.items() if k != "tp"}), LLAMA, model)
        above.use_graphs, above._capturer = True, _EagerCapturer()
        above.tp = off.get("tp", 1)  # (the TP=1 engine's sums: only the decision to capture reads tp)
        c = above.generate(PROMPTS, lengths, SamplingParams(greedy=True))
        assert not above._prefill_graphs and torch.equal(c.response_tokens_BR, want), off


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_prefills_last_layer_runs_proj_and_mlp_on_each_prompts_last_position(cfg, monkeypatch):
    """decoder.PREFILL_LAST_ONLY: the last layer's proj and MLP (and the final norm) see each prompt's last position
    only, [B, 1, H], every other layer's all positions; the logits and the cache it leaves equal those of the
    whole-width last layer (up to float32 rounding of the narrower GEMMs). GPT-2: LayerNorm, biases everywhere."""
    from aligner.generation.native import decoder as decoder_mod

    model = _model(cfg)
    engine = build_engine(GEN, cfg, model)
    dec = engine.decoder
    seen = []
    real = dec._row_parallel
    monkeypatch.setattr(dec, "_row_parallel", lambda x, *a: seen.append(tuple(x.shape)) or real(x, *a))
    lengths = LENGTHS.to(dec.device)
    got = dec.prefill(PROMPTS.clamp(min=0), lengths).clone()
    cache = dec.kv[:, :, :4].clone()
    B, T, H, L = *PROMPTS.shape, cfg.hidden_size, cfg.num_layers
    # proj then fc2 per layer: the last layer's two on [B, 1, .] (fc2's input is the MLP's width)
    assert [s[:2] for s in seen] == [(B, T)] * 2 * (L - 1) + [(B, 1)] * 2 and seen[-2][2] == H, seen
    monkeypatch.setattr(decoder_mod, "PREFILL_LAST_ONLY", False)
    seen.clear()
    want = dec.prefill(PROMPTS.clamp(min=0), lengths)
    assert [s[:2] for s in seen] == [(B, T)] * 2 * L
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert torch.equal(dec.kv[:, :, :4], cache)


@pytest.mark.parametrize("share", ["off", "auto"])
def test_refit_copies_new_weights_into_the_same_buffers(share):
    """off: the engine's own copy, stale until refit; auto (fp32 policy, fp32 engine on CPU): the policy's tensors
    themselves, current without a copy. Either way the buffers graphs read never move."""
    from dataclasses import replace

    from aligner.models.training import TrainableModel

    torch.manual_seed(0)
    trainable = TrainableModel(LLAMA, OptimConfig(lr=3e-2, clip_grad=0.0))
    trainable.module.eval()
    engine = build_engine(replace(GEN, share_weights=share), LLAMA, trainable.module)
    ptrs = engine.buffer_data_ptrs()
    policy_ptrs = {f"weight:{n}": p.data_ptr() for n, p in trainable.module.named_parameters()}
    assert engine.weights.shared == (share == "auto")
    if engine.weights.shared:
        assert {k: v for k, v in ptrs.items() if k.startswith("weight:")} == policy_ptrs
        assert engine.weights.owned_nbytes() == 0 < engine.weights.nbytes()
    else:
        assert not set(ptrs.values()) & set(policy_ptrs.values())
    before = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))

    tokens = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))

    def loss_fn(batch, logits):  # push the logits around: any differentiable function of them will do
        return logits.float().logsumexp(-1).mean() - logits.float()[..., 7].mean(), {}

    trainable.step([{"tokens": tokens}], loss_fn)
    trainable.module.eval()
    new_ref = training_logprobs(
        trainable.module, PROMPTS, LENGTHS, before.response_tokens_BR, before.response_lengths_B, 1.0, V
    )
    assert (new_ref - before.logprobs_BR).abs().max() > 1e-3, "the step must change the policy for this test to bite"
    if not engine.weights.shared:
        stale = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        assert torch.equal(stale.logprobs_BR, before.logprobs_BR), "the engine holds a copy, not the live weights"

    engine.refit(trainable)  # a TrainableModel, a DDP wrapper or the bare module are all accepted
    assert engine.buffer_data_ptrs() == ptrs
    for name, p in trainable.module.named_parameters():
        assert torch.equal(engine.weights.get(name), p.detach()), name
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    assert _responses(out) == reference_greedy(trainable.module, PROMPTS, LENGTHS, 12, V)
    ref = training_logprobs(trainable.module, PROMPTS, LENGTHS, out.response_tokens_BR, out.response_lengths_B, 1.0, V)
    torch.testing.assert_close(out.logprobs_BR, ref, rtol=0, atol=2e-5)
    assert engine.buffer_data_ptrs() == ptrs


def test_shared_weights_follow_moved_storage_and_on_refuses_a_copy():
    from dataclasses import replace

    model = _model(LLAMA)
    engine = build_engine(replace(GEN, share_weights="on"), LLAMA, model)
    engine._graphs[("stale",)] = lambda: None  # as if a graph had been captured over the old addresses
    first = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    engine.refit(model)
    assert engine.num_graphs == 1, "nothing moved: graphs are kept"
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()  # new storage, same values (what a param.data re-assignment does)
    engine.refit(model)
    assert engine.num_graphs == 0, "graphs over the old storage must be dropped"
    assert engine.weights.data_ptrs() == {n: p.data_ptr() for n, p in model.named_parameters()}
    again = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    assert torch.equal(again.response_tokens_BR, first.response_tokens_BR)
    with pytest.raises(ValueError, match="share_weights=on is not possible here: the engine's dtype"):
        build_engine(replace(GEN, share_weights="on", dtype="bfloat16"), LLAMA, model)
    assert not build_engine(replace(GEN, dtype="bfloat16"), LLAMA, model).weights.shared


def test_shared_bf16_matrices_with_fp32_norms_generate_as_the_copy():
    """A bf16 model without apex/TE (as on the GPU machine): megatron's norms are fp32 parameters. The engine reads
    the bf16 matrices in place and copies (casts) only the norms; it generates what its full bf16 copy generates,
    also after the weights change."""
    from dataclasses import replace

    cfg = replace(LLAMA, params_dtype="bfloat16")
    model = _model(cfg)
    norms = {n: p for n, p in model.named_parameters() if "layernorm" in n}
    assert norms and all(p.dtype == torch.float32 for p in norms.values()), "the premise: fp32 norms"
    shared = build_engine(GEN, cfg, model)
    copy = build_engine(replace(GEN, share_weights="off"), cfg, model)
    assert shared.weights.shared and not copy.weights.shared
    assert 0 < shared.weights.owned_nbytes() == sum(p.numel() * 2 for p in norms.values())
    weight = dict(model.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    assert shared.weights.get("decoder.layers.0.mlp.linear_fc1.weight").data_ptr() == weight.data_ptr()
    for step in range(2):
        a = shared.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        b = copy.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
        assert torch.equal(a.response_tokens_BR, b.response_tokens_BR) and torch.equal(a.logprobs_BR, b.logprobs_BR)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype))
        shared.refit(model)
        copy.refit(model)


def test_release_acquire_and_input_errors():
    model = _model(LLAMA)
    engine = build_engine(GEN, LLAMA, model)
    assert isinstance(engine, ReleasableMemory)
    first = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    engine.release_memory()
    assert engine.decoder.kv is None
    with pytest.raises(RuntimeError, match="acquire_memory"):
        engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    engine.acquire_memory()
    assert torch.equal(
        engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True)).response_tokens_BR, first.response_tokens_BR
    )
    too_many = torch.zeros(6, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.generate(too_many, torch.ones(6, dtype=torch.long), SamplingParams(greedy=True))
    with pytest.raises(ValueError, match="max_prompt_length"):
        engine.generate(torch.zeros(1, 11, dtype=torch.long), torch.tensor([11]), SamplingParams(greedy=True))
    with pytest.raises(ValueError, match="vocab_size"):
        engine.generate(torch.full((1, 3), V), torch.tensor([3]), SamplingParams(greedy=True))
    with pytest.raises(ValueError, match="prompt lengths"):
        engine.generate(PROMPTS, torch.tensor([0, 1, 2, 3]), SamplingParams(greedy=True))
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True, max_new_tokens=13))


def test_a_pipeline_stage_without_a_pipeline_group_is_refused(monkeypatch):
    """PP > 1 itself is supported (tests/distributed/test_generation_tp.py); a stage module that does not match
    megatron's parallel state is a usage error, named as such."""
    model = _model(LLAMA)
    monkeypatch.setattr(model, "pre_process", False)
    with pytest.raises(ValueError, match="one pipeline stage but megatron's parallel state says PP=1"):
        build_engine(GEN, LLAMA, model)


def test_trtllm_backend_is_lazy_and_explains_its_absence():
    pytest.importorskip("megatron.core")
    try:
        import tensorrt_llm  # noqa: F401

        pytest.skip("tensorrt_llm is installed: the adapter's own tests apply")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="backend=native"):
        build_engine(GenerationConfig(backend="trtllm"), LLAMA, _model(LLAMA))


def test_flash_and_triton_decode_attention_are_refused_off_cuda(monkeypatch):
    """`flash` and `triton` name why they cannot run (here: no CUDA) instead of failing inside a decode step; `auto`
    takes matmul on the CPU. The flash kernel is checked on a GPU (scripts/bench_generation.py --decode-attention
    flash: its log-prob gap to megatron's forward); measured slower than matmul there (docs/PERF.md). The Triton
    kernels run here under Triton's interpreter (the greedy test above); without it, they are refused (the split-K
    GEMMs too: decode_gemm=splitk); `auto` takes cuBLAS on the CPU."""
    model = _model(LLAMA)
    with pytest.raises(ValueError, match=r"generation.decode_attention=flash is not possible here: it needs a CUDA"):
        build_engine(GenerationConfig(**{**GEN.__dict__, "decode_attention": "flash"}), LLAMA, model)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"generation.decode_attention=triton is not possible here: (it needs|Tri)"):
        build_engine(GenerationConfig(**{**GEN.__dict__, "decode_attention": "triton"}), LLAMA, model)
    with pytest.raises(ValueError, match=r"generation.decode_gemm=splitk is not possible here: (it needs|Tri)"):
        build_engine(GenerationConfig(**{**GEN.__dict__, "decode_gemm": "splitk"}), LLAMA, model)
    engine = build_engine(GEN, LLAMA, model)
    assert engine.decode_attention == "matmul" and not engine.decoder.seq_major
    assert engine.decode_gemm == "cublas"


def test_auto_decode_gemm_warns_when_the_split_k_check_fails_on_a_gpu(monkeypatch, caplog):
    """decode_gemm=auto on a GPU at TP=1 whose split-K start-up check fails takes cuBLAS with a warning naming the
    reason (a failed check is unexpected there, and it costs decode speed); at TP > 1 cuBLAS is the design, said
    at info level."""
    import logging
    from types import SimpleNamespace

    from aligner.generation.native import splitk
    from aligner.generation.native.engine import NativeEngine

    monkeypatch.setattr(splitk, "unavailable", lambda *a, **k: "the kernel failed here (CompilationError: K >= 32)")
    gpu = SimpleNamespace(on_gpu=True, device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="aligner.generation.native.engine"):
        assert NativeEngine._choose_decode_gemm(gpu, "auto", 1, torch.bfloat16, True) == "cublas"
        assert NativeEngine._choose_decode_gemm(gpu, "auto", 2, torch.bfloat16) == "cublas"
    levels = [(r.levelno, "K >= 32" in r.getMessage() or "TP=1 only" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, True)], levels
    with pytest.raises(ValueError, match="decode_gemm=splitk is not possible here: the kernel failed"):
        NativeEngine._choose_decode_gemm(gpu, "splitk", 1, torch.bfloat16)


def test_fp8_kv_cache_needs_the_triton_kernel(monkeypatch):
    """generation.kv_dtype=fp8: only the Triton decode kernel reads such a cache. Another decode_attention is a config
    mistake named by its key; `auto` where the kernel cannot run (here: the CPU, without the interpreter's explicit
    `triton`) is refused with the reason instead of falling back to a path that cannot read it."""
    from aligner.config.generation import validate_generation
    from aligner.config.rules import ConfigError

    for attention in ("matmul", "sdpa", "flash"):
        with pytest.raises(ConfigError, match=r"generation.kv_dtype.*decode_attention=triton or auto"):
            validate_generation(GenerationConfig(kv_dtype="fp8", decode_attention=attention))
    validate_generation(GenerationConfig(kv_dtype="fp8"))
    model = _model(LLAMA)
    with pytest.raises(ValueError, match=r"generation.kv_dtype=fp8 is not possible here: .*\(CPU\); use kv_dtype=auto"):
        build_engine(GenerationConfig(**{**GEN.__dict__, "kv_dtype": "fp8"}), LLAMA, model)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # an explicit triton where the kernel cannot run
    with pytest.raises(ValueError, match=r"decode_attention=triton is not possible here: .*; use kv_dtype=auto"):
        build_engine(
            GenerationConfig(**{**GEN.__dict__, "kv_dtype": "fp8", "decode_attention": "triton"}), LLAMA, model
        )


def test_prefill_kernels_compile_once_for_every_batch_and_width():
    """Prefill's compiled RoPE: batch and prompt width dynamic, the model's sizes fixed (one graph for all calls;
    fully symbolic shapes made the GPU kernel several times slower), and equal to the eager maths."""
    import shutil

    from torch._dynamo.utils import counters

    from aligner.families import family
    from aligner.generation.native.fused import make_kernels

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile on CPU needs a C++ compiler")
    eager = make_kernels(family("llama"), 1e-5, False, prefill=True)
    compiled = make_kernels(family("llama"), 1e-5, True, prefill=True)
    graphs = counters["stats"]["unique_graphs"]
    for B, T in ((4, 16), (3, 7), (6, 20)):
        qkv, cos, sin = torch.randn(B, T, 2, 4, 8), torch.randn(T, 1, 1, 8), torch.randn(T, 1, 1, 8)
        for got, want in zip(compiled.rope_split(qkv, cos, sin), eager.rope_split(qkv, cos, sin)):
            torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    qkv, cos = torch.randn(2, 5, 2, 4, 16), torch.randn(5, 1, 1, 16)  # another head dimension: a size of its own
    compiled.rope_split(qkv, cos, cos)
    assert counters["stats"]["unique_graphs"] - graphs == 2
