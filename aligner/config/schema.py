"""Typed config sections shared by the jobs. Each default lives here and only here.

YAML files in conf/ are merged onto these dataclasses by `aligner.config.load` (unknown keys and wrong types are
errors that name the key); `validate_*` functions check the rules a type cannot express.
Job-level schemas (the actor's, the critic's) compose these sections in their own modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

from aligner import families
from aligner.config.rules import check as _check
from aligner.config.rules import check_choices

Dtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class ModelConfig:
    """A decoder-only transformer as megatron-core builds it. `arch` names its family (aligner.families: norms,
    MLP, biases, positions, HF names), e.g. llama (also Llama 3.x with `rope_scaling`, Mistral, Qwen2 with
    `add_qkv_bias`, Qwen3 with `qk_layernorm` and `head_dim`, SmolLM3 with `nope_layers`) or gpt2. With
    `checkpoint` set, the jobs fill every key the config does not set from the checkpoint's model.yaml
    (aligner.config.from_checkpoint)."""

    arch: str = "llama"  # a family name: aligner.families.names()
    num_layers: int = 2  # transformer layers
    hidden_size: int = 64  # model width
    num_attention_heads: int = 4  # query heads per layer
    num_query_groups: Optional[int] = None  # grouped-query attention; None = one KV head per query head
    ffn_hidden_size: Optional[int] = None  # None = 4 * hidden_size
    vocab_size: int = 256  # the tokenizer's; padded up for TP (see make_vocab_size_divisible_by)
    make_vocab_size_divisible_by: int = 128  # embedding rows are padded to a multiple of this x TP
    max_position_embeddings: int = 2048  # longest sequence (prompt + response) the model is built for
    rotary_base: float = 10000.0  # RoPE theta (rotary families)
    norm_epsilon: float = 1e-5  # epsilon of the RMSNorm / LayerNorm layers
    tie_embeddings: bool = False  # the output layer shares the input embedding's weights
    add_qkv_bias: bool = False  # Qwen2
    init_method_std: float = 0.02  # std of the random initialisation (weights not loaded from a checkpoint)
    params_dtype: Dtype = "float32"  # dtype of the parameters (training)
    attention_backend: Literal["auto", "sdpa", "unfused", "te"] = "auto"  # auto: TE where installed, else sdpa
    hidden_dropout: float = 0.0  # dropout after attention and MLP (0 for RL)
    attention_dropout: float = 0.0  # dropout of the attention probabilities
    checkpoint: Optional[str] = None  # a dist checkpoint (e.g. from scripts/convert_hf_to_nemo.py) to load
    tokenizer: Optional[str] = None  # path to an HF tokenizer (directory or tokenizer.json)
    # RoPE frequency scaling: null = plain; llama3 = Llama 3.1+'s; longrope = Phi-3 128k's and Phi-3.5's (short factors)
    rope_scaling: Optional[Literal["llama3", "longrope"]] = None  # null | llama3 | longrope (see the line above)
    rope_scaling_factor: float = 8.0  # llama3 scaling: low frequencies are divided by this (Llama 3.1: 8, 3.2: 32)
    rope_scaling_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original/this are scaled
    rope_scaling_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original/this are kept
    rope_scaling_original_max_position_embeddings: int = 8192  # llama3 / longrope scaling: the pre-training context
    rope_scaling_short_factor: Optional[list[float]] = None  # longrope: each frequency's divisor (head_dim / 2 numbers)
    rope_scaling_long_factor: Optional[list[float]] = None  # longrope: those beyond the pre-training context (export)
    rope_scaling_attention_factor: float = 1.0  # longrope: RoPE's cos and sin are multiplied by this (HF's)
    rotary_percent: float = 1.0  # the share of each head's width RoPE rotates, the rest passing (Phi-4-mini: 0.75)
    head_dim: Optional[int] = None  # width of one attention head (megatron's kv_channels); None = hidden / heads
    qk_layernorm: bool = False  # Qwen3: each head's queries and keys are normalised (the family's norm) before RoPE
    nope_layers: list[int] = field(default_factory=list)  # layers (0-based, as HF numbers them) without RoPE (SmolLM3)
    # Activation recomputation in training: memory for compute, a runtime setting never taken from a checkpoint.
    recompute: Literal["none", "selective", "full"] = "none"  # selective: attention core | full: whole layers
    sequence_parallel: bool = False  # TP > 1: norms/residuals split along the sequence (less activation memory)
    recompute_method: Literal["uniform", "block"] = "uniform"  # full: every layer in chunks | the first N per stage
    recompute_num_layers: int = 1  # full: uniform: layers per recomputed chunk | block: layers recomputed per stage
    rope_fusion: Literal["auto", "on", "off"] = "auto"  # RoPE in one fused kernel (auto: on GPU with Triton)
    logprob_fusion: Literal["auto", "on", "off"] = "auto"  # log-probs in compiled kernels (auto: on GPU with Triton)

    @property
    def kv_channels(self) -> int:
        """The width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


def rotated_width(model: ModelConfig) -> int:
    """How many of a head's channels RoPE rotates (HF's and megatron's int(head width x share))."""
    return int(model.kv_channels * model.rotary_percent)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1  # TP: each layer's matrices split over this many ranks
    pipeline_model_parallel_size: int = 1  # PP: the layers split into this many stages
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl on GPU, gloo on CPU
    master_addr: Optional[str] = None  # default: from the launcher's environment
    master_port: Optional[int] = None  # default: from the launcher's environment (MASTER_PORT)
    timeout_minutes: float = 30.0  # a collective that does not complete in time is an error naming rank, group, op


@dataclass
class OptimConfig:
    lr: float = 1e-5  # peak learning rate (Adam)
    min_lr: float = 0.0  # learning rate at the end of the cosine decay
    weight_decay: float = 0.0  # decoupled weight decay (AdamW)
    adam_beta1: float = 0.9  # Adam's first-moment decay
    adam_beta2: float = 0.95  # Adam's second-moment decay
    adam_eps: float = 1e-8  # Adam's epsilon
    clip_grad: float = 1.0  # clip the global gradient norm to this (0 = no clipping)
    warmup_steps: int = 0  # optimizer steps of linear warm-up to lr
    lr_decay_steps: Optional[int] = None  # None = constant after warm-up
    use_distributed_optimizer: bool = True  # megatron's, on GPU; ignored on CPU
    overlap_grad_reduce: bool = False  # DP > 1: reduce gradients in buckets during the backward, not after it
    grad_bucket_size: Optional[int] = None  # elements per gradient bucket with overlap (None = megatron's default)
    fused_adam: Literal["auto", "off"] = "auto"  # auto: torch's fused AdamW kernel on GPUs (without apex/TE)


@dataclass
class CheckpointConfig:
    """Where a job's checkpoints go and whether it resumes; the same section (and defaults) in every job."""

    dir: Optional[str] = None  # None = <exp_dir>/checkpoints
    resume: bool = True  # continue from the latest complete checkpoint under `dir`
    keep: Optional[int] = 2  # keep only the newest N checkpoints (None = all)


@dataclass
class ProfiledLoggingConfig:
    """The profiling keys every training job's `logging` section has (aligner.utils.profiling)."""

    profile_step: int = -1  # run this step under torch.profiler: a trace and a per-phase table in <exp_dir>/profile
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # the global ranks that profile it


def validate_profiling(logging, prefix: str = "logging") -> None:
    _check(
        logging.profile_step >= -1, f"{prefix}.profile_step", f"must be >= 0 (or -1: none), got {logging.profile_step}"
    )
    _check(
        all(r >= 0 for r in logging.profile_ranks),
        f"{prefix}.profile_ranks",
        f"must be global ranks (>= 0), got {list(logging.profile_ranks)}",
    )


def validate_model(model: ModelConfig, prefix: str = "model") -> None:
    _check(
        model.arch in families.names(),
        f"{prefix}.arch",
        f"must be one of {', '.join(families.names())}, got {model.arch!r}",
    )
    for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
        _check(getattr(model, name) > 0, f"{prefix}.{name}", "must be positive")
    if model.head_dim is None:
        _check(
            model.hidden_size % model.num_attention_heads == 0,
            f"{prefix}.hidden_size",
            f"{model.hidden_size} is not divisible by num_attention_heads={model.num_attention_heads} "
            f"(or set {prefix}.head_dim)",
        )
    else:
        _check(model.head_dim > 0, f"{prefix}.head_dim", f"must be positive (or null), got {model.head_dim}")
    rope = families.family(model.arch).rope
    if rope:
        _check(
            model.kv_channels % 2 == 0,
            f"{prefix}.head_dim",
            f"RoPE rotates pairs of dimensions: the head width {model.kv_channels} must be even",
        )
    if model.rope_scaling is not None:
        _check(rope, f"{prefix}.rope_scaling", f"the {model.arch} family has no RoPE to scale: set it to null")
        _check(
            model.rope_scaling_factor >= 1,
            f"{prefix}.rope_scaling_factor",
            f"must be >= 1, got {model.rope_scaling_factor}",
        )
        _check(
            0 < model.rope_scaling_low_freq_factor < model.rope_scaling_high_freq_factor,
            f"{prefix}.rope_scaling_low_freq_factor",
            f"must be > 0 and below rope_scaling_high_freq_factor={model.rope_scaling_high_freq_factor}, "
            f"got {model.rope_scaling_low_freq_factor}",
        )
        _check(
            model.rope_scaling_original_max_position_embeddings > 0,
            f"{prefix}.rope_scaling_original_max_position_embeddings",
            "must be positive",
        )
    if rope:
        rotated = rotated_width(model)
        _check(
            0 < model.rotary_percent <= 1 and rotated > 0 and rotated % 2 == 0,
            f"{prefix}.rotary_percent",
            f"must be in (0, 1] and rotate an even number of the head's {model.kv_channels} channels, got "
            f"{model.rotary_percent} ({rotated} channels)",
        )
    if model.rope_scaling == "longrope":
        pairs = rotated_width(model) // 2
        for name in ("rope_scaling_short_factor", "rope_scaling_long_factor"):
            factors = getattr(model, name)
            _check(
                factors is not None and len(factors) == pairs and all(f > 0 for f in factors),
                f"{prefix}.{name}",
                f"longrope needs {pairs} positive numbers (one per frequency: rotated width / 2), got {factors}",
            )
        _check(
            model.max_position_embeddings <= model.rope_scaling_original_max_position_embeddings,
            f"{prefix}.max_position_embeddings",
            f"longrope is supported within its pre-training context: at most "
            f"rope_scaling_original_max_position_embeddings={model.rope_scaling_original_max_position_embeddings}, "
            f"got {model.max_position_embeddings}",
        )
        _check(
            model.rope_scaling_attention_factor > 0,
            f"{prefix}.rope_scaling_attention_factor",
            f"must be positive, got {model.rope_scaling_attention_factor}",
        )
        _check(
            model.rotary_percent == 1 or model.attention_backend in ("auto", "sdpa"),
            f"{prefix}.attention_backend",
            f"{model.attention_backend!r} cannot scale the channels RoPE passes (LongRoPE's attention factor with "
            "rotary_percent < 1, as Phi-4-mini): use auto or sdpa",
        )
    if model.nope_layers:
        nope = list(model.nope_layers)
        _check(rope, f"{prefix}.nope_layers", f"the {model.arch} family has no RoPE to leave out: set it to []")
        _check(
            all(0 <= i < model.num_layers for i in nope) and len(set(nope)) == len(nope),
            f"{prefix}.nope_layers",
            f"must list distinct layers in [0, num_layers={model.num_layers}) (0-based, as HF numbers them), "
            f"got {nope}",
        )
        _check(
            model.rope_scaling != "longrope",
            f"{prefix}.nope_layers",
            "layers without RoPE are not supported with rope_scaling=longrope (its attention factor scales every "
            "layer)",
        )
    groups = model.num_query_groups or model.num_attention_heads
    _check(
        model.num_attention_heads % groups == 0,
        f"{prefix}.num_query_groups",
        f"num_attention_heads={model.num_attention_heads} is not divisible by num_query_groups={groups}",
    )
    check_choices(model, prefix + ".")
    _check(model.make_vocab_size_divisible_by > 0, f"{prefix}.make_vocab_size_divisible_by", "must be positive")
    _check(model.recompute_num_layers >= 1, f"{prefix}.recompute_num_layers", "must be >= 1")
    if model.recompute_method == "uniform":
        _check(
            model.num_layers % model.recompute_num_layers == 0,
            f"{prefix}.recompute_num_layers",
            f"must divide num_layers={model.num_layers} (megatron recomputes whole chunks), got "
            f"{model.recompute_num_layers}; or recompute_method=block recomputes the first N layers of each stage",
        )


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
    check_choices(parallel, parallel_prefix + ".")
    _check(parallel.timeout_minutes > 0, f"{parallel_prefix}.timeout_minutes", "must be > 0")
    _check(
        model.num_attention_heads % tp == 0,
        f"{parallel_prefix}.tensor_model_parallel_size",
        f"{model_prefix}.num_attention_heads={model.num_attention_heads} is not divisible by TP={tp}",
    )
    if model.recompute == "full" and model.num_layers % pp == 0:
        per_stage = model.num_layers // pp
        if model.recompute_method == "uniform":
            _check(
                per_stage % model.recompute_num_layers == 0,
                f"{model_prefix}.recompute_num_layers",
                f"must divide the {per_stage} layers of each of the {pp} pipeline stages, got "
                f"{model.recompute_num_layers}",
            )
        else:
            _check(
                model.recompute_num_layers <= per_stage,
                f"{model_prefix}.recompute_num_layers",
                f"recompute_method=block recomputes at most the {per_stage} layers of a pipeline stage, got "
                f"{model.recompute_num_layers}",
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


def validate_optim(optim: OptimConfig, prefix: str = "optim") -> None:
    for name in ("lr", "min_lr", "weight_decay", "adam_eps", "clip_grad"):
        value = getattr(optim, name)
        _check(math.isfinite(value) and value >= 0, f"{prefix}.{name}", f"must be a finite number >= 0, got {value}")
    _check(optim.lr > 0, f"{prefix}.lr", f"must be > 0, got {optim.lr}")
    _check(optim.min_lr <= optim.lr, f"{prefix}.min_lr", f"{optim.min_lr} exceeds {prefix}.lr={optim.lr}")
    for name in ("adam_beta1", "adam_beta2"):
        value = getattr(optim, name)
        _check(0 <= value < 1, f"{prefix}.{name}", f"must lie in [0, 1), got {value}")
    _check(optim.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
    if optim.lr_decay_steps is not None:
        _check(optim.lr_decay_steps >= 1, f"{prefix}.lr_decay_steps", "must be >= 1 (or null for a constant lr)")


def validate_checkpoint(ckpt: CheckpointConfig, prefix: str = "checkpoint") -> None:
    _check(ckpt.keep is None or ckpt.keep >= 1, f"{prefix}.keep", f"must be >= 1 or null, got {ckpt.keep}")


def validate_batch(global_batch: int, micro_batch: int, dp: int, global_key: str, micro_key: str) -> None:
    _check(micro_batch >= 1, micro_key, "must be >= 1")
    _check(
        global_batch % (micro_batch * dp) == 0,
        global_key,
        f"{global_batch} is not divisible by {micro_key}={micro_batch} x data-parallel size {dp}",
    )


__all__ = [
    "CheckpointConfig",
    "Dtype",
    "ModelConfig",
    "ParallelConfig",
    "OptimConfig",
    "validate_batch",
    "validate_checkpoint",
    "validate_layout",
    "validate_model",
    "validate_optim",
]
