"""Build megatron-core GPTModels (policy, reference, critic, reward model) from a `ModelConfig`.

"What the model is" lives here: the TransformerConfig and layer spec, from the family's traits
(aligner.families) and the ModelConfig's shapes. The layer spec is chosen once:
Transformer Engine's spec when TE imports and a GPU is present (`attention_backend: auto|te`), otherwise megatron's
local spec with `SDPAttention` as the attention core (`auto|sdpa`), or megatron's unfused `DotProductAttention`
(`unfused`, the reference path). Heads: `lm` (vocab-parallel output layer) or `scalar` (one value per position,
replicated across TP ranks) for critics and reward models.
Call after `aligner.parallel.initialize` (the model reads megatron's TP/PP groups).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from aligner.config.schema import ModelConfig, rotated_width
from aligner.families import family
from aligner.models import logprobs
from aligner.models.attention import NoPESelfAttention, SDPAttention
from aligner.models.dtypes import torch_dtype
from aligner.models.norm import TorchNorm
from aligner.models.rope import passed_channel_scale, rope_inv_freq, softmax_scale
from aligner.parallel.device import current_device, on_gpu


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """megatron pads the vocabulary so every TP rank holds an equal slice; the padding logits are never sampled."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def _te_available() -> bool:
    return on_gpu() and importlib.util.find_spec("transformer_engine") is not None


def resolve_attention_backend(requested: str) -> str:
    if requested == "te" and not _te_available():
        raise ValueError("model.attention_backend=te needs Transformer Engine and a GPU; use auto, sdpa or unfused")
    if requested == "auto":
        return "te" if _te_available() else "sdpa"
    return requested


def transformer_config(cfg: ModelConfig, pipeline_dtype: torch.dtype | None = None) -> TransformerConfig:
    dtype = torch_dtype(cfg.params_dtype)
    traits = family(cfg.arch)
    on_cpu = not on_gpu()
    logprobs.set_fusion(cfg.logprob_fusion)  # the process's log-prob kernels (aligner.models.logprobs), chosen here
    return TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size or 4 * cfg.hidden_size,
        kv_channels=cfg.kv_channels,
        qk_layernorm=cfg.qk_layernorm,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        normalization=traits.normalization,
        layernorm_epsilon=cfg.norm_epsilon,
        gated_linear_unit=traits.gated_mlp,
        activation_func=traits.activation_func(),
        add_bias_linear=traits.linear_bias,
        add_qkv_bias=traits.qkv_bias(cfg),
        rotary_interleaved=traits.rotary_interleaved,
        hidden_dropout=cfg.hidden_dropout,
        attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=pipeline_dtype or dtype,
        # megatron's jit-fused SwiGLU and bias-dropout-add need neither apex nor TE: on for the GPU. GELU stays
        # unfused so GPT-2's tanh approximation is the same function on every device. Fused RoPE: TE's kernel or
        # aligner's Triton one (aligner.models.rope_fusion, model.rope_fusion). Fusions that need apex or TE
        # (persistent layer norm, masked softmax) stay off: the SDPA path needs neither.
        bias_activation_fusion=traits.gated_mlp and traits.activation == "silu" and not on_cpu,
        bias_dropout_fusion=not on_cpu,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=_rope_fusion(cfg, traits, not on_cpu),
        gradient_accumulation_fusion=False,
        use_cpu_initialization=on_cpu,
        perform_initialization=True,
        attention_softmax_in_fp32=True,
        softmax_scale=softmax_scale(cfg),  # None: 1 / sqrt(head width); LongRoPE's attention factor squared on it
        # megatron's sequence parallelism (with TP > 1 only): the embedding scatters the sequence over the TP ranks,
        # the parallel linears all-gather / reduce-scatter it, the output layer gathers it back; inputs must then be
        # a multiple of TP long (aligner.models.gpt.pad_for_sequence_parallel)
        sequence_parallel=cfg.sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1,
        **_recompute(cfg),
    )


def _rope_fusion(cfg: ModelConfig, traits, gpu: bool) -> bool:
    from aligner.models import rope_fusion as rope

    if not rope.wanted(cfg.rope_fusion, traits.rope, traits.rotary_interleaved, gpu):
        return False
    rope.install()  # before TransformerConfig checks that a fused kernel exists
    return True


def _recompute(cfg: ModelConfig) -> dict:
    """megatron's activation recomputation settings for `model.recompute` (applied in training mode only)."""
    if cfg.recompute == "selective":
        return {"recompute_granularity": "selective"}  # megatron's default module: the attention core
    if cfg.recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": cfg.recompute_method,
            "recompute_num_layers": cfg.recompute_num_layers,
        }
    return {}


def _without_rope_in(spec: ModuleSpec, cfg: ModelConfig) -> ModuleSpec:
    """The layer spec with its self-attention leaving RoPE out in `cfg.nope_layers` (SmolLM3), unchanged without."""
    if not cfg.nope_layers:
        return spec
    sa = spec.submodules.self_attention
    params = {**sa.params, "nope_layers": frozenset(cfg.nope_layers)}
    sa = dataclasses.replace(sa, module=NoPESelfAttention, params=params)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=sa))


def layer_spec(cfg: ModelConfig, config: TransformerConfig):
    """Transformer Engine's layer spec, or megatron's local one with our attention core and norms (aligner.models.norm:
    they work under sequence parallelism); the local one as a whole block so that the final norm is ours too."""
    passed = passed_channel_scale(cfg)  # schema.validate_model allows this with auto or sdpa only
    backend = "sdpa" if passed is not None else resolve_attention_backend(cfg.attention_backend)
    if backend == "te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return _without_rope_in(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=cfg.qk_layernorm), cfg)
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = get_gpt_layer_local_spec(normalization=family(cfg.arch).normalization, qk_layernorm=cfg.qk_layernorm)
    layer = spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = TorchNorm
    if cfg.qk_layernorm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = TorchNorm
    if backend == "sdpa":
        layer.self_attention.submodules.core_attention = SDPAttention
        if passed is not None:
            params = {"passed_channels": (rotated_width(cfg), passed)}
            layer.self_attention.submodules.core_attention = ModuleSpec(module=SDPAttention, params=params)
    spec = _without_rope_in(spec, cfg)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=TorchNorm)


class ScalarHead(torch.nn.Module):
    """Stands where GPTModel's output layer does and maps hidden states to one value per position.

    A replicated [hidden, 1] projection of hidden states that are replicated across TP ranks gives identical values
    on every TP rank. Under sequence parallelism the hidden states arrive split along the sequence: they are
    gathered first, and in the backward each rank keeps its own slice of the (identical) gradient.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, std: float, sequence_parallel: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        torch.nn.init.normal_(self.weight, std=std)
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_SBH, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

            hidden_SBH = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False)
        return F.linear(hidden_SBH, self.weight, self.bias), None


def build_gpt(cfg: ModelConfig, head: str = "lm") -> GPTModel:
    """This rank's TP/PP slice of the model, on the current device (GPU if present, else CPU), in params_dtype.

    forward(input_ids [B,T], position_ids [B,T], attention_mask=None) returns, on the last pipeline stage,
    logits [B, T, V_padded / TP] for `lm` or values [B, T, 1] for `scalar`; on other stages, hidden states.
    """
    if head not in ("lm", "scalar"):
        raise ValueError(f"head must be 'lm' or 'scalar', got {head!r}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(cfg)
    traits = family(cfg.arch)
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config),
        vocab_size=padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp),
        max_sequence_length=cfg.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.tie_embeddings and head == "lm",
        position_embedding_type=traits.position_embedding,
        rotary_percent=cfg.rotary_percent,
        rotary_base=int(cfg.rotary_base),
    )
    if traits.rope:
        # Our frequencies, not megatron's: its llama3 scaling hard-codes three of the four numbers and its base is
        # an int; these follow the config exactly (aligner.models.rope), and the native engine reads them from here.
        inv_freq = model.rotary_pos_emb.inv_freq
        model.rotary_pos_emb.inv_freq = rope_inv_freq(cfg).to(inv_freq.device)
    if pre and getattr(model.embedding, "position_embeddings", None) is not None:
        # megatron builds learned positions (GPT-2) as a plain torch.nn.Embedding in float32, whatever params_dtype
        # is (its bf16 module wrapper, which we do not use, would cast it): a bf16 model's embedding sum then came out
        # in float32 and its first layer refused it
        model.embedding.position_embeddings.to(torch_dtype(cfg.params_dtype))
    if head == "scalar" and post:
        model.output_layer = ScalarHead(
            cfg.hidden_size, torch_dtype(cfg.params_dtype), cfg.init_method_std, config.sequence_parallel
        )
    return model.to(current_device())


def position_ids_like(tokens_BT: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens_BT.shape[1], device=tokens_BT.device).unsqueeze(0).expand_as(tokens_BT)


def sequence_multiple(model) -> int:
    """The length inputs must be a multiple of: TP under sequence parallelism, else 1."""
    return parallel_state.get_tensor_model_parallel_world_size() if model.config.sequence_parallel else 1


def pad_for_sequence_parallel(multiple: int, tokens_BT, position_ids_BT, attention_mask=None):
    """Right-pad one micro-batch to a multiple of `multiple` tokens (sequence parallelism splits the sequence
    evenly over the TP ranks). Causal attention keeps real positions from seeing the padding, so their outputs
    are unchanged; the caller cuts the outputs back to the input's length. A padded mask keeps the padding rows
    causal (no row fully masked: no NaN in the backward)."""
    T = tokens_BT.shape[1]
    extra = -T % multiple
    if extra == 0:
        return tokens_BT, position_ids_BT, attention_mask
    tokens_BT = F.pad(tokens_BT, (0, extra))
    last = position_ids_BT[:, -1:]
    position_ids_BT = torch.cat([position_ids_BT, last + torch.arange(1, extra + 1, device=last.device)], dim=1)
    if attention_mask is not None:
        full = T + extra
        causal_masked = torch.ones(full, full, dtype=torch.bool, device=attention_mask.device).triu(1)
        padded = causal_masked.expand(attention_mask.shape[0], 1, full, full).clone()
        padded[:, :, :T, :T] = attention_mask
        attention_mask = padded
    return tokens_BT, position_ids_BT, attention_mask


def forward(model: GPTModel, tokens_BT: torch.Tensor) -> torch.Tensor:
    """Plain (non-pipelined) causal forward of a whole model on this rank: logits_BTV/TP or values [B,T,1]."""
    T = tokens_BT.shape[1]
    tokens, positions, _ = pad_for_sequence_parallel(sequence_multiple(model), tokens_BT, position_ids_like(tokens_BT))
    return model(tokens, positions, attention_mask=None)[:, :T]
