"""TensorRT-LLM backend: the weight conversion (pure reshaping) here; the engine itself only where it is installed."""

import pytest
import torch

from aligner.generation.trtllm import trtllm_llama_weights


def test_per_group_qkv_becomes_q_then_k_then_v():
    groups, r, D, H = 2, 3, 4, 5
    # tag every row of megatron's fused qkv with (group, slot, dim) so the new order can be read back
    rows = [(g, slot, d) for g in range(groups) for slot in range(r + 2) for d in range(D)]
    qkv = torch.tensor([[g * 1000 + slot * 10 + d] * H for g, slot, d in rows], dtype=torch.float32)
    local = {
        "embedding.word_embeddings.weight": torch.zeros(8, H),
        "decoder.final_layernorm.weight": torch.ones(H),
        "decoder.layers.0.self_attention.linear_qkv.weight": qkv,
        "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(H, groups * r * D),
        "decoder.layers.0.input_layernorm.weight": torch.ones(H),
        "decoder.layers.0.pre_mlp_layernorm.weight": torch.ones(H),
        "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([torch.full((6, H), 1.0), torch.full((6, H), 2.0)]),
        "decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(H, 6),
    }
    out = trtllm_llama_weights(local, num_layers=1, heads=groups * r, groups=groups, head_dim=D)
    tags = out["transformer.layers.0.attention.qkv.weight"][:, 0].long().tolist()
    q = [g * 1000 + s * 10 + d for g in range(groups) for s in range(r) for d in range(D)]
    k = [g * 1000 + r * 10 + d for g in range(groups) for d in range(D)]
    v = [g * 1000 + (r + 1) * 10 + d for g in range(groups) for d in range(D)]
    assert tags == q + k + v
    assert (out["transformer.layers.0.mlp.fc.weight"] == 1).all()
    assert (out["transformer.layers.0.mlp.gate.weight"] == 2).all()
    assert out["lm_head.weight"] is not None  # tied: the embedding


def test_trtllm_engine_matches_native_and_refits():
    """Runs only where TensorRT-LLM and a GPU are present (never here): first greedy tokens agree with the native
    engine on the same weights, and refit after a weight change changes the outputs like the native engine's."""
    pytest.importorskip("tensorrt_llm", reason="TensorRT-LLM is not installed here; its engine cannot be built")
    if not torch.cuda.is_available():
        pytest.skip("TensorRT-LLM needs a GPU")
    from dist import free_port

    from aligner.config.schema import ModelConfig
    from aligner.generation import GenerationConfig, SamplingParams, build_engine
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        params_dtype="bfloat16",
        init_method_std=0.2,
    )
    model = build_gpt(cfg).eval()
    gen = GenerationConfig(max_batch_size=4, max_prompt_length=16, max_response_length=8)
    native = build_engine(gen, cfg, model)
    trt = build_engine(GenerationConfig(**{**gen.__dict__, "backend": "trtllm"}), cfg, model)
    prompts = torch.randint(0, 512, (4, 16), device="cuda")
    lengths = torch.tensor([16, 9, 3, 12], device="cuda")
    sp = SamplingParams(greedy=True, ignore_eos=True)
    for _ in range(2):
        a, b = native.generate(prompts, lengths, sp), trt.generate(prompts, lengths, sp)
        assert torch.equal(a.response_tokens_BR[:, 0], b.response_tokens_BR[:, 0])
        torch.testing.assert_close(a.logprobs_BR[:, 0], b.logprobs_BR[:, 0], atol=0.05, rtol=0)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.1)
        native.refit(model)
        trt.refit(model)
