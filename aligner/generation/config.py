"""The `generation` section of the actor's config: which backend, and the fixed shapes the engine is built for.

Each default lives here; `validate_generation` checks the rules a type cannot express and names the key.
The engine sizes its KV cache for max_batch_size x (max_prompt_length + max_response_length) tokens once.
"""

from __future__ import annotations

from dataclasses import dataclass

from aligner.config.errors import ConfigError
from aligner.config.schema import DTYPES
from aligner.models.families import family

BACKENDS = ("native", "trtllm")


@dataclass
class GenerationConfig:
    backend: str = "native"  # native (our engine) | trtllm (TensorRT-LLM, where installed)
    max_batch_size: int = 64  # prompts per generate() call on this rank
    max_prompt_length: int = 128
    max_response_length: int = 256
    dtype: str = "auto"  # engine weights: auto = bfloat16 on GPU, the policy's dtype on CPU | float32 | bfloat16 | ...
    kv_dtype: str = "auto"  # auto = the engine's dtype
    cuda_graphs: bool = True  # capture the decode step on GPU (ignored on CPU)
    compile_elementwise: str = "auto"  # fuse norms/RoPE/activations with torch.compile: auto (GPU with Triton)|on|off
    decode_attention: str = "matmul"  # matmul (batched GEMMs, GQA without copies) | sdpa
    kv_block: int = 64  # decode attends over the cache rounded up to a multiple of this (one graph per multiple)
    prefill_max_tokens: int = 32768  # prompts are prefilled in row chunks of at most this many tokens
    check_done_every: int = 16  # decode steps between host checks of "every sample ended" (each check syncs)


def validate_generation(gen: GenerationConfig, model=None, prefix: str = "generation") -> None:
    def check(cond, key, msg):
        if not cond:
            raise ConfigError(f"{prefix}.{key}", msg)

    check(gen.backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {gen.backend!r}")
    for key in (
        "max_batch_size",
        "max_prompt_length",
        "max_response_length",
        "kv_block",
        "prefill_max_tokens",
        "check_done_every",
    ):
        check(getattr(gen, key) >= 1, key, "must be >= 1")
    dtypes = ("auto", *DTYPES)
    check(gen.dtype in dtypes, "dtype", f"must be one of {dtypes}")
    check(gen.kv_dtype in dtypes, "kv_dtype", f"must be one of {dtypes}")
    check(gen.decode_attention in ("matmul", "sdpa"), "decode_attention", "must be matmul or sdpa")
    check(gen.compile_elementwise in ("auto", "on", "off"), "compile_elementwise", "must be auto, on or off")
    if model is not None and family(model.arch).position_embedding == "learned_absolute":
        total = gen.max_prompt_length + gen.max_response_length
        check(
            total <= model.max_position_embeddings,
            "max_response_length",
            f"max_prompt_length + max_response_length = {total} exceeds model.max_position_embeddings="
            f"{model.max_position_embeddings} (learned positions): shorten them",
        )
