"""The `generation` section of the actor's config: which backend, and the fixed shapes the engine is built for.

Each default lives here; `validate_generation` checks the rules a type cannot express and names the key.
The engine sizes its KV cache for max_batch_size x (max_prompt_length + max_response_length) tokens once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aligner.config.rules import check, check_choices

DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]
KvDtypeChoice = Literal["auto", "float32", "bfloat16", "float16", "fp8"]


@dataclass
class GenerationConfig:
    backend: Literal["native", "trtllm"] = "native"  # native (our engine) | trtllm (TensorRT-LLM, where installed)
    max_batch_size: int = 64  # prompts per generate() call on this rank
    max_prompt_length: int = 128  # longest prompt in tokens (longer ones: data.long_prompts)
    max_response_length: int = 256  # most tokens generated per response
    dtype: DtypeChoice = "auto"  # engine weights: auto = bfloat16 on GPU, the policy's dtype on CPU
    kv_dtype: KvDtypeChoice = "auto"  # auto = the engine's dtype; fp8: e4m3 with per-slot scales (GENERATION.md)
    share_weights: Literal["auto", "on", "off"] = "auto"  # engine reads the policy tensors, no copy (auto: if it can)
    cuda_graphs: bool = True  # capture the decode step on GPU (ignored on CPU)
    compile_elementwise: Literal["auto", "on", "off"] = "auto"  # torch.compile of norms/RoPE/activations (auto: GPU)
    decode_attention: Literal["auto", "matmul", "sdpa", "flash", "triton"] = "auto"  # auto: triton on GPU, else matmul
    decode_weights: Literal["same", "fp8"] = "same"  # fp8: decode's MLP/output GEMMs in FP8 (off-policy; GENERATION.md)
    decode_gemm: Literal["auto", "cublas", "splitk"] = "auto"  # splitk: Triton proj/fc2 in decode (auto: GPU, TP=1)
    token_choice: Literal["auto", "torch", "triton"] = "auto"  # triton: greedy/plain sampling in 2 kernels (auto: GPU)
    kv_block: int = 64  # matmul/sdpa/flash attend over the cache up to a multiple of this (a graph per multiple)
    prefill_max_tokens: int = 32768  # prompts are prefilled in row chunks of at most this many tokens
    prefill_repeats_once: bool = True  # a prompt repeated in neighbouring rows (a group's samples): prefilled once
    prefill_graph_max_tokens: int = 16384  # cuda_graphs: chunks of <= this many tokens replay a graph (0: off; TP=1,
    # not with release_kv_cache: the graphs hold their activations' memory)
    check_done_every: int = 16  # decode steps between host checks of "every sample ended" (each check syncs)
    release_kv_cache: bool = False  # free the KV cache for scoring and training (graphs re-captured if it moves)


def validate_generation(gen: GenerationConfig, model=None, prefix: str = "generation") -> None:
    """The engine's rules (the one place they are checked); with `model`, the lengths against its positions."""
    check_choices(gen, prefix + ".")
    for key in (
        "max_batch_size",
        "max_prompt_length",
        "max_response_length",
        "kv_block",
        "prefill_max_tokens",
        "check_done_every",
    ):
        check(getattr(gen, key) >= 1, f"{prefix}.{key}", "must be >= 1")
    check(
        gen.prefill_graph_max_tokens >= 0, f"{prefix}.prefill_graph_max_tokens", "must be >= 0 (0: no prefill graphs)"
    )
    check(
        gen.decode_weights == "same" or gen.backend == "native",
        f"{prefix}.decode_weights",
        "fp8 is a setting of the native engine: use backend=native (or decode_weights=same)",
    )
    check(
        gen.decode_gemm != "splitk" or gen.backend == "native",
        f"{prefix}.decode_gemm",
        "splitk is a setting of the native engine: use backend=native (or decode_gemm=auto)",
    )
    check(
        gen.token_choice != "triton" or gen.backend == "native",
        f"{prefix}.token_choice",
        "triton is a setting of the native engine: use backend=native (or token_choice=auto)",
    )
    check(
        gen.kv_dtype != "fp8" or (gen.backend == "native" and gen.decode_attention in ("auto", "triton")),
        f"{prefix}.kv_dtype",
        "an FP8 cache is read by the native engine's Triton decode attention only: use backend=native and "
        "decode_attention=triton or auto (or kv_dtype=auto)",
    )
    if model is not None:
        total = gen.max_prompt_length + gen.max_response_length
        check(
            total <= model.max_position_embeddings,
            f"{prefix}.max_response_length",
            f"max_prompt_length + max_response_length = {total} exceeds model.max_position_embeddings="
            f"{model.max_position_embeddings}: shorten them (or use a model built for longer sequences)",
        )
