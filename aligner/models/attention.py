"""A megatron-core `core_attention` module backed by PyTorch's scaled_dot_product_attention.

megatron's local `DotProductAttention` materialises the [b, heads, s, s] score matrix; SDPA dispatches to
flash / memory-efficient kernels on GPU (and a fused math path on CPU), without Transformer Engine.
Same constructor and forward signature as `DotProductAttention`, so it drops into the local layer spec.
Masking: causal by default (decoder-only LMs with right padding: padding sits after every real token, so the causal
mask alone keeps real tokens from seeing it). An explicit `attention_mask` (megatron's convention: bool
[b, 1, sq, sk], True = masked out) replaces it, e.g. the block-diagonal causal mask of packed sequences
(aligner.data.packing); with a mask, grouped KV heads are expanded first, because the memory-efficient SDPA kernel
takes a mask but not `enable_gqa` (the math fallback would materialise the full score matrix).
Packed rows without a mask: `packed_seq_params` as `Segments` (the samples' starts in the rows laid end to end) runs
causal attention inside each sample only: on a GPU in 16-bit by PyTorch's variable-length flash kernel (the
samples' own causal blocks, grouped KV heads as they are: none of the dense mask's work across samples), elsewhere
by SDPA over one sample at a time (the same maths; a reference, slow for many samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from aligner.data import packing


@dataclass
class Segments(PackedSeqParams):
    """Samples packed side by side in a micro-batch's rows, for `SDPAttention`: `cu_seqlens_q` (= `cu_seqlens_kv`)
    int32 [n + 1], where each of the n samples starts in the [B x T] tokens of the rows laid end to end, then B x T
    (aligner.data.packing.segment_starts); `longest` the longest sample; `tokens` B x T. megatron reads
    `qkv_format` ('sbhd': its tensors keep their usual layout, RoPE by position in the row) and `max_seqlen_q` /
    `max_seqlen_kv` (the rows' width T: its RoPE table's length)."""

    longest: int = 0
    tokens: int = 0

    @classmethod
    def of(cls, segment_ids_BT: torch.Tensor, device=None) -> "Segments":
        """The segments of packed rows' `segment_ids` [B, T] (aligner.data.packing), computed where the ids are and
        handed to `device` (default: there). A micro-batch keeps its ids on the CPU (`collate`): found there, the
        starts cost the host no wait for the GPU's queued work (on the GPU, reading them back would)."""
        starts, longest = packing.segment_starts(segment_ids_BT)
        if device is not None:
            starts = starts.to(device, non_blocking=True)  # staged from the CPU at once: nothing waits
        rows, width = segment_ids_BT.shape
        return cls(
            qkv_format="sbhd",
            cu_seqlens_q=starts,
            cu_seqlens_kv=starts,
            max_seqlen_q=width,
            max_seqlen_kv=width,
            longest=longest,
            tokens=rows * width,
        )


class NoPESelfAttention(SelfAttention):
    """megatron's self-attention, without RoPE in the layers `nope_layers` names (0-based; SmolLM3's NoPE layers):
    those attend by content alone, as HF's model skips its rotation there. megatron numbers layers from 1 across
    pipeline stages (`layer_number`), so one spec serves every layer of every stage."""

    def __init__(self, *args, nope_layers: frozenset = frozenset(), **kwargs):
        super().__init__(*args, **kwargs)
        self.rope = self.layer_number - 1 not in nope_layers

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb if self.rope else None, **kwargs)


def scale_channels_from(x: torch.Tensor, first: int, scale: float) -> torch.Tensor:
    """x with each head's channels from `first` on (the last dimension) times `scale`."""
    return torch.cat((x[..., :first], x[..., first:] * scale), dim=-1)


class SDPAttention(MegatronModule):
    def __init__(
        self,
        config,
        layer_number,
        attn_mask_type,
        attention_type,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
        passed_channels: tuple[int, float] | None = None,
    ):
        """`passed_channels` = (c, s): each head's channels from c on (those RoPE passes through) of q and k times s
        first (aligner.models.rope.passed_channel_scale: LongRoPE's attention factor with part of the head rotated)."""
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not support context parallelism")
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.passed_channels = passed_channels

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]."""
        if attention_bias is not None or not (packed_seq_params is None or isinstance(packed_seq_params, Segments)):
            raise NotImplementedError(
                "SDPAttention: THD packed sequences and attention bias are not supported "
                "(pack with an attention_mask or aligner.models.attention.Segments)"
            )
        if self.passed_channels is not None:
            first, scale = self.passed_channels
            query, key = scale_channels_from(query, first, scale), scale_channels_from(key, first, scale)
        if packed_seq_params is not None:
            return self._segments(query, key, value, packed_seq_params)
        if query.shape[0] != key.shape[0] and query.shape[0] != 1:
            raise NotImplementedError("SDPAttention: chunked prefill over a cache (1 < sq != sk) is not supported")
        q_bhsd = query.permute(1, 2, 0, 3)
        k_bhsd = key.permute(1, 2, 0, 3)
        v_bhsd = value.permute(1, 2, 0, 3)
        gqa = self.heads_per_partition != self.groups_per_partition
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA's bool mask says where attention IS allowed
            if gqa:
                repeat = self.heads_per_partition // self.groups_per_partition
                k_bhsd = k_bhsd.repeat_interleave(repeat, dim=1)
                v_bhsd = v_bhsd.repeat_interleave(repeat, dim=1)
                gqa = False
        out_bhsd = F.scaled_dot_product_attention(
            q_bhsd,
            k_bhsd,
            v_bhsd,
            attn_mask=mask,
            is_causal=mask is None and query.shape[0] > 1,  # one query over a cache needs no mask
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.softmax_scale,
            enable_gqa=gqa,
        )
        sq, b = query.shape[0], query.shape[1]
        return out_bhsd.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * self.head_dim)

    def _segments(self, query, key, value, segments: Segments):
        """Causal attention inside each packed sample (see the module docstring); [sq, b, ...] as `forward`."""
        sq, b = query.shape[0], query.shape[1]
        if key.shape[0] != sq or segments.tokens != b * sq:
            raise ValueError(f"Segments cover {segments.tokens} tokens; the rows hold {b} x {sq}")
        q_ND, k_ND, v_ND = (x.transpose(0, 1).reshape(b * sq, x.shape[2], x.shape[3]) for x in (query, key, value))
        dropout = self.dropout_p if self.training else 0.0
        out_ND = segment_attention(
            q_ND, k_ND, v_ND, segments.cu_seqlens_q, segments.longest, self.softmax_scale, dropout
        )
        return out_ND.reshape(b, sq, -1).transpose(0, 1).contiguous()


def flash_takes(cuda: bool, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether PyTorch's variable-length flash kernel takes attention on a CUDA device (or not) in `dtype` with
    heads `head_dim` wide: where it does, `segment_attention` runs it."""
    return cuda and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def segment_attention(q_ND, k_ND, v_ND, starts, longest: int, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention inside each segment [starts[i], starts[i + 1]) of the tokens: q [N, H, D], k and v
    [N, G, D] (G divides H: grouped KV heads) -> [N, H, D]. The flash kernel where it runs (`flash_takes`), else
    SDPA one segment at a time."""
    if flash_takes(q_ND.is_cuda, q_ND.dtype, q_ND.shape[-1]):
        return torch.ops.aten._flash_attention_forward(
            q_ND, k_ND, v_ND, starts, starts, longest, longest, dropout, True, False, scale=scale
        )[0]
    bounds = starts.tolist()
    parts = [
        F.scaled_dot_product_attention(
            *(x[start:end].transpose(0, 1) for x in (q_ND, k_ND, v_ND)),
            is_causal=True,
            dropout_p=dropout,
            scale=scale,
            enable_gqa=q_ND.shape[1] != k_ND.shape[1],
        ).transpose(0, 1)
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(parts)


def varlen_check(device, dtype: torch.dtype) -> str | None:
    """None when `segment_attention` on `device` in `dtype` gives, within that dtype's rounding, the outputs and
    gradients of dense attention with a block-diagonal causal mask in float32 on the CPU (three segments, grouped KV
    heads, head width 64); else why not (an exception's message or the largest difference). The SFT trainer runs it
    before it takes the flash kernel for packed rows."""
    try:
        g = torch.Generator().manual_seed(0)
        starts, longest, scale = torch.tensor([0, 5, 17, 40], dtype=torch.int32), 23, 0.125
        inputs = [torch.randn(40, heads, 64, generator=g) for heads in (4, 2, 2)]
        grad = torch.randn(40, 4, 64, generator=g)
        leaves = [x.to(dtype).to(device).requires_grad_() for x in inputs]
        out = segment_attention(*leaves, starts.to(device), longest, scale)
        out.backward(grad.to(dtype).to(device))
        got = [t.detach().float().cpu() for t in (out, *(x.grad for x in leaves))]
        leaves = [x.to(dtype).float().requires_grad_() for x in inputs]  # the same values, float32 maths
        segment_N = torch.repeat_interleave(torch.arange(3), starts.diff())
        allowed = (segment_N[:, None] == segment_N[None, :]) & torch.ones(40, 40, dtype=torch.bool).tril()
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in leaves)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
        ref = ref.squeeze(0).transpose(0, 1)
        ref.backward(grad.to(dtype).float())
        want = [t.detach() for t in (ref, *(x.grad for x in leaves))]
        for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
            error = float((a - b).abs().max()) / max(1.0, float(b.abs().max()))
            if not error < 0.05:
                return f"{name} differs by {error:.3g} (relative to its largest value) from masked attention"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"{type(exc).__name__}: {exc}"
    return None
