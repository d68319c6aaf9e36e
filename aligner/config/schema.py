"""Typed config sections shared by the jobs. Each default lives here and only here.

YAML files in conf/ are merged onto these dataclasses by `aligner.config.load` (unknown keys and wrong types are
errors that name the key); `validate_*` functions check the rules a type cannot express.
Job-level schemas (the actor's, the critic's) compose these sections in their own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from aligner.config.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    """A decoder-only transformer as megatron-core builds it. `arch` picks the family defaults:
    llama (RMSNorm, SwiGLU, RoPE, no biases; covers Llama 2/3, Mistral, Qwen2 with `add_qkv_bias`) or
    gpt2 (LayerNorm, GELU, learned positions, biases)."""

    arch: str = "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # grouped-query attention; None = one KV head per query head
    ffn_hidden_size: Optional[int] = None  # None = 4 * hidden_size
    vocab_size: int = 256  # the tokenizer's; padded up for TP (see make_vocab_size_divisible_by)
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    add_qkv_bias: bool = False  # Qwen2
    init_method_std: float = 0.02
    params_dtype: str = "float32"
    attention_backend: str = "auto"  # auto | sdpa | unfused | te
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    checkpoint: Optional[str] = None  # a dist checkpoint (e.g. from scripts/convert_hf_to_nemo.py) to load
    tokenizer: Optional[str] = None  # path to an HF tokenizer (directory or tokenizer.json)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    master_addr: Optional[str] = None  # default: from the launcher's environment
    master_port: Optional[int] = None
    timeout_minutes: int = 30


@dataclass
class OptimConfig:
    lr: float = 1e-5
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    lr_decay_steps: Optional[int] = None  # None = constant after warm-up
    use_distributed_optimizer: bool = True  # megatron's, on GPU; ignored on CPU


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(key, message)


def validate_model(model: ModelConfig, prefix: str = "model") -> None:
    _check(model.arch in ("llama", "gpt2"), f"{prefix}.arch", f"must be llama or gpt2, got {model.arch!r}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
        _check(getattr(model, name) > 0, f"{prefix}.{name}", "must be positive")
    _check(
        model.hidden_size % model.num_attention_heads == 0,
        f"{prefix}.hidden_size",
        f"{model.hidden_size} is not divisible by num_attention_heads={model.num_attention_heads}",
    )
    groups = model.num_query_groups or model.num_attention_heads
    _check(
        model.num_attention_heads % groups == 0,
        f"{prefix}.num_query_groups",
        f"num_attention_heads={model.num_attention_heads} is not divisible by num_query_groups={groups}",
    )
    _check(model.params_dtype in DTYPES, f"{prefix}.params_dtype", f"must be one of {DTYPES}")
    _check(
        model.attention_backend in ("auto", "sdpa", "unfused", "te"),
        f"{prefix}.attention_backend",
        "must be auto, sdpa, unfused or te",
    )
    _check(model.make_vocab_size_divisible_by > 0, f"{prefix}.make_vocab_size_divisible_by", "must be positive")


def validate_layout(
    model: ModelConfig,
    parallel: ParallelConfig,
    world_size: Optional[int],
    model_prefix: str = "model",
    parallel_prefix: str = "parallel",
) -> int:
    """Check that the model can be split as asked on `world_size` ranks; returns the data-parallel size."""
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    _check(tp >= 1, f"{parallel_prefix}.tensor_model_parallel_size", "must be >= 1")
    _check(pp >= 1, f"{parallel_prefix}.pipeline_model_parallel_size", "must be >= 1")
    _check(parallel.backend in ("auto", "nccl", "gloo"), f"{parallel_prefix}.backend", "must be auto, nccl or gloo")
    _check(
        model.num_attention_heads % tp == 0,
        f"{parallel_prefix}.tensor_model_parallel_size",
        f"{model_prefix}.num_attention_heads={model.num_attention_heads} is not divisible by TP={tp}",
    )
    groups = model.num_query_groups or model.num_attention_heads
    _check(
        groups % tp == 0,
        f"{parallel_prefix}.tensor_model_parallel_size",
        f"{model_prefix}.num_query_groups={groups} is not divisible by TP={tp}",
    )
    _check(
        model.num_layers % pp == 0,
        f"{parallel_prefix}.pipeline_model_parallel_size",
        f"{model_prefix}.num_layers={model.num_layers} is not divisible by PP={pp}",
    )
    if world_size is None:
        return 1
    _check(
        world_size % (tp * pp) == 0,
        f"{parallel_prefix}.tensor_model_parallel_size",
        f"world size {world_size} is not divisible by TP*PP={tp}*{pp}: launch a multiple of {tp * pp} ranks",
    )
    return world_size // (tp * pp)


def validate_batch(global_batch: int, micro_batch: int, dp: int, global_key: str, micro_key: str) -> None:
    _check(micro_batch >= 1, micro_key, "must be >= 1")
    _check(
        global_batch % (micro_batch * dp) == 0,
        global_key,
        f"{global_batch} is not divisible by {micro_key}={micro_batch} x data-parallel size {dp}",
    )


__all__ = [
    "ModelConfig",
    "ParallelConfig",
    "OptimConfig",
    "validate_model",
    "validate_layout",
    "validate_batch",
]
