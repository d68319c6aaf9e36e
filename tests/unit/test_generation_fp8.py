"""FP8 decode weights (`generation.decode_weights: fp8`, aligner/generation/native/fp8.py).

The reference: megatron's own forward with the same rounding put in by hooks (generation_reference.fake_fp8). Equal to
the engine up to float32 rounding, and far from the plain forward. TP=2: tests/distributed/test_generation_tp.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from generation_reference import training_logprobs
from test_generation_engine import GEN, GPT2, LENGTHS, LLAMA, PROMPTS, QWEN3, V, _model, megatron_tp1  # noqa: F401

from aligner.config.rules import ConfigError
from aligner.generation import GenerationConfig, SamplingParams, build_engine
from aligner.generation.native.fp8 import E4M3, quantize_rows
from aligner.generation.native.replay import fake_fp8


def test_quantize_rows_by_hand():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.3, -0.03]])
    x8, s = quantize_rows(x)
    assert x8.dtype == E4M3 and s.shape == (3, 1)
    # row 0: max |x| = 2 maps to 448; 1 -> 224, 0.5 -> 112: all exact in e4m3
    assert x8[0].float().tolist() == [224.0, -448.0, 112.0] and s[0, 0] == pytest.approx(2 / 448)
    assert x8[1].float().tolist() == [0.0, 0.0, 0.0]  # an all-zero row stays zero (scale floored, no NaN)
    # row 2: 0.3 * 448/3 = 44.8 -> 44 (e4m3 has steps of 4 between 32 and 64); -4.48 -> -4.5 (steps of 0.5)
    assert x8[2].float().tolist() == [448.0, 44.0, -4.5]
    deq = x8.float() * s
    assert (deq - x).abs().max() <= 2 * 3 / 448 * 4  # at most half a step of the largest bucket


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, QWEN3], ids=["llama", "gpt2", "qwen3"])
def test_fp8_decode_equals_megatron_with_the_same_rounding(cfg):
    """Llama (qkv bias, SwiGLU), GPT-2 (LayerNorm, biases everywhere, tied output layer), Qwen3 (q/k norms)."""
    model = _model(cfg)
    with torch.no_grad():  # megatron builds biases as zeros: make each count, so a bias dropped or misplaced shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    engine = build_engine(replace(GEN, decode_weights="fp8"), cfg, model)
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    n = out.response_lengths_B
    plain = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, n, 1.0, V)
    with fake_fp8(model, LENGTHS, int((LENGTHS + n).max())):
        rounded = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, n, 1.0, V)
    valid = torch.arange(out.logprobs_BR.shape[1])[None] < n[:, None]
    gap_rounded = (out.logprobs_BR - rounded).abs()[valid]
    gap_plain = (out.logprobs_BR - plain).abs()[valid]
    assert gap_rounded.max() < 2e-3, gap_rounded.max()
    assert gap_plain.mean() > 10 * gap_rounded.mean(), "FP8 rounding must show against the plain forward"
    # token 0 comes from prefill: its MLPs on the FP8 copies too, its output layer in the engine's dtype
    assert (out.logprobs_BR[:, 0] - rounded[:, 0]).abs().max() < 2e-5
    assert (out.logprobs_BR[:, 0] - plain[:, 0]).abs().max() > 1e-4


def _count_calls(monkeypatch, modules: dict, keep=lambda args: args[0].shape) -> dict:
    """Each named function of its module (name -> module) wrapped to record keep(its positional arguments) at every
    call; returns name -> the records."""
    calls = {name: [] for name in modules}
    for name, module in modules.items():
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, r=real, c=calls[name], **kw: c.append(keep(a)) or r(*a, **kw))
    return calls


def _llama_fp8_engine(monkeypatch, **limits):
    """(cfg, model, engine): a small Llama (fc2's K fits the split-K tiling) and its engine with FP8 decode weights and
    split-K GEMMs, built with splitk's row limits set as given (name=value)."""
    from aligner.generation.native import splitk

    cfg = replace(LLAMA, ffn_hidden_size=128)
    model = _model(cfg)
    for name, value in limits.items():
        monkeypatch.setattr(splitk, name, value)
    return cfg, model, build_engine(replace(GEN, decode_weights="fp8", decode_gemm="splitk"), cfg, model)


def _gap_to_fp8_megatron(model, out):
    """|the engine's log-probs - megatron's forward with FP8 qkv, MLP and output layer rounding| over the responses."""
    n = out.response_lengths_B
    valid = torch.arange(out.logprobs_BR.shape[1])[None] < n[:, None]
    with fake_fp8(model, LENGTHS, int((LENGTHS + n).max()), qkv=True):
        rounded = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, n, 1.0, V)
    return (out.logprobs_BR - rounded).abs()[valid]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp8_mlp_by_the_triton_kernels_equals_megatron_with_the_same_rounding(monkeypatch, arch):
    """decode_gemm=splitk (Triton's interpreter): a SwiGLU MLP's fc1, its scales and the activation in one kernel
    (splitk.gated_matmul_fp8), the activation then quantized per row, fc2 by the split-K kernel on FP8 operands
    (splitk.matmul_fp8), qkv (its input quantized by the norm before it) and the output layer by that kernel in one K
    range, the add+norm+quantize after proj and fc2 and the activation's quantization by the row kernels (rows.py):
    the same rounding as megatron's forward with FP8 qkv, MLP and output layer. GPT-2 (GELU, biases, LayerNorm): fc1
    stays with cuBLAS and the activation kernel, fc2 by the split-K kernel with its bias after it, qkv's bias after
    the kernel's product, the norms compiled. Prefill's qkv on the FP8 copies too (cuBLAS's row-wise scaled FP8
    GEMM), so the first token's log-prob has qkv's rounding. Without FP8 qkv in the reference the engine is far off:
    qkv's rounding shows."""
    from aligner.generation.native import fp8, rows, splitk

    # fc2's K fits the split-K tiling (4 ranges of 32)
    cfg = replace(LLAMA, ffn_hidden_size=128) if arch == "llama" else replace(GPT2, ffn_hidden_size=128)
    model = _model(cfg)
    with torch.no_grad():  # megatron builds biases as zeros: make each count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    engine = build_engine(replace(GEN, decode_weights="fp8", decode_gemm="splitk"), cfg, model)
    calls = _count_calls(
        monkeypatch,
        {"gated_matmul_fp8": splitk, "matmul_fp8": splitk, "add_parts_norm": rows, "quantize_rows": rows}
        | {"matmul_rowwise": fp8},
    )
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    # every decode step (the first token comes from prefill), every layer: fc2 and qkv, and the output layer; with
    # RMSNorm the two add+norm+quantize kernels of a layer and the activation's quantization by rows.py's kernels
    llama = arch == "llama"
    assert {name: len(seen) for name, seen in calls.items()} == {
        "gated_matmul_fp8": 11 * cfg.num_layers if llama else 0,
        "matmul_fp8": 11 * (2 * cfg.num_layers + 1),
        "add_parts_norm": 11 * 2 * cfg.num_layers if llama else 0,
        "quantize_rows": 11 * cfg.num_layers if llama else 0,
        "matmul_rowwise": cfg.num_layers,  # prefill's qkv: one call, every layer
    }, {name: len(seen) for name, seen in calls.items()}
    n = out.response_lengths_B
    valid = torch.arange(out.logprobs_BR.shape[1])[None] < n[:, None]
    gaps, first = {}, {}
    for qkv in (True, False):
        with fake_fp8(model, LENGTHS, int((LENGTHS + n).max()), qkv=qkv):
            rounded = training_logprobs(model, PROMPTS, LENGTHS, out.response_tokens_BR, n, 1.0, V)
        gaps[qkv] = (out.logprobs_BR - rounded).abs()[valid]
        first[qkv] = (out.logprobs_BR[:, 0] - rounded[:, 0]).abs().max()  # token 0: prefill's
    assert gaps[True].max() < 2e-3, gaps[True].max()
    assert gaps[False].mean() > 5 * gaps[True].mean(), gaps
    assert first[True] < 2e-5 and first[False] > 1e-4, first


def test_fp8_decode_above_the_kernels_row_limits_equals_megatron_with_the_same_rounding(monkeypatch):
    """decode_gemm=splitk with more rows than its kernels take (their limits set below the test's batch, as 513 rows
    of the 1B model meet them): qkv and the output layer by cuBLAS's row-wise scaled FP8 GEMM (scales in its
    epilogue), fc1 and fc2 by cuBLAS's FP8 GEMM with the compiled kernels after them: the same rounding as
    megatron's forward with FP8 qkv, MLP and output layer."""
    from aligner.generation.native import fp8, splitk

    cfg, model, engine = _llama_fp8_engine(monkeypatch, MAX_BATCH=1, GATED_MAX_BATCH=1, ROW_BLOCKS_MAX_BATCH=1)
    calls = _count_calls(monkeypatch, {"matmul_rowwise": fp8, "matmul_fp8": splitk, "gated_matmul_fp8": splitk})
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    steps = 11  # decode steps (the first token comes from prefill)
    assert {name: len(seen) for name, seen in calls.items()} == {
        "matmul_rowwise": cfg.num_layers + steps * (cfg.num_layers + 1),  # prefill's qkv; decode's qkv and output
        "matmul_fp8": 0,
        "gated_matmul_fp8": 0,
    }
    gap = _gap_to_fp8_megatron(model, out)
    assert gap.max() < 2e-3, gap.max()


def test_fp8_decode_in_row_blocks_equals_megatron_with_the_same_rounding(monkeypatch):
    """Between the kernels' one-block limits and ROW_BLOCKS_MAX_BATCH (as 256 rows of the 1B model): fc1 with its
    activation and qkv by the Triton kernels in blocks of ROW_BLOCK rows (2 here: two blocks for four prompts), fc2
    and the output layer by cuBLAS; the same rounding as megatron's forward with FP8 qkv, MLP and output layer."""
    from aligner.generation.native import fp8, splitk

    cfg, model, engine = _llama_fp8_engine(monkeypatch, MAX_BATCH=1, GATED_MAX_BATCH=1, ROW_BLOCK=2)
    modules = {"matmul_rowwise": fp8, "matmul_fp8": splitk, "gated_matmul_fp8": splitk, "matmul": fp8}
    calls = _count_calls(monkeypatch, modules, keep=lambda args: args[4:5])  # the split-K kernels' tiling
    out = engine.generate(PROMPTS, LENGTHS, SamplingParams(greedy=True))
    steps = 11  # decode steps (the first token comes from prefill)
    L = cfg.num_layers
    assert {name: len(seen) for name, seen in calls.items()} == {
        "matmul_rowwise": L + steps,  # prefill's qkv; decode's output layer
        "matmul_fp8": steps * L,  # decode's qkv
        "gated_matmul_fp8": steps * L,  # decode's fc1
        "matmul": 2 * L + steps * L,  # prefill's fc1 and fc2; decode's fc2
    }
    assert {t.block_m for (t,) in calls["matmul_fp8"] + calls["gated_matmul_fp8"]} == {2}
    gap = _gap_to_fp8_megatron(model, out)
    assert gap.max() < 2e-3, gap.max()


def test_refit_requantizes_into_the_same_buffers():
    model = _model(LLAMA)
    engine = build_engine(replace(GEN, decode_weights="fp8", share_weights="auto"), LLAMA, model)
    ptrs = engine.buffer_data_ptrs()
    assert any(k.startswith("fp8:") for k in ptrs)
    fc1 = model.decoder.layers[1].mlp.linear_fc1.weight
    with torch.no_grad():
        fc1.mul_(3.0).add_(0.01)
    w8, s = engine.decoder.fp8.layer(1, 1)
    assert not torch.allclose(w8.float() * s[:, None], fc1, atol=0.05), "stale before refit"
    engine.refit(model)
    assert engine.buffer_data_ptrs() == ptrs
    rel = (w8.float() * s[:, None] - fc1).abs() / fc1.abs().amax(1, keepdim=True)
    assert rel.max() <= 16 / 448 + 1e-6  # half of e4m3's largest step (32, in [256, 448]) over its largest value


def test_requantize_hands_each_weight_to_quantize_into_where_it_runs(monkeypatch):
    """With split-K GEMMs (their Triton kernels checked at start-up) the engine re-quantizes through
    rows.quantize_into (one kernel a weight on the GPU); requantize writes what quantize_into answers for, and the
    chunked quantize_rows elsewhere: the same copies either way."""
    from aligner.generation.native import fp8, rows

    cfg, model, engine = _llama_fp8_engine(monkeypatch)
    eager = engine.decoder.fp8
    assert eager._quantize_into is rows.quantize_into  # (it answers False on the CPU: the copies above are eager)
    seen = []

    def every_other(w, w8, scale):  # quantize_rows's answer for every other weight, "cannot" for the rest
        seen.append(tuple(w.shape))
        if len(seen) % 2:
            return False
        q, s = fp8.quantize_rows(w)
        w8.copy_(q)
        scale.copy_(s.view(-1))
        return True

    mixed = fp8.DecodeFp8(engine.weights, torch.device("cpu"), qkv=True, quantize_into=every_other)
    assert len(seen) == len(eager.names) == 3 * cfg.num_layers + 1
    for name in eager.names:
        assert torch.equal(mixed.w8[name].view(torch.uint8), eager.w8[name].view(torch.uint8)), name
        assert torch.equal(mixed.scale[name], eager.scale[name]), name


def test_fp8_is_a_native_setting():
    from aligner.config.generation import validate_generation

    with pytest.raises(ConfigError, match="generation.decode_weights"):
        validate_generation(GenerationConfig(backend="trtllm", decode_weights="fp8"))
