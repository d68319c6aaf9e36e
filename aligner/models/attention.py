"""A megatron-core `core_attention` module backed by PyTorch's scaled_dot_product_attention.

megatron's local `DotProductAttention` materialises the [b, heads, s, s] score matrix; SDPA dispatches to
flash / memory-efficient kernels on GPU (and a fused math path on CPU), without Transformer Engine.
Same constructor and forward signature as `DotProductAttention`, so it drops into the local layer spec.
Masking: causal by default (decoder-only LMs with right padding: padding sits after every real token, so the causal
mask alone keeps real tokens from seeing it). An explicit `attention_mask` (megatron's convention: bool
[b, 1, sq, sk], True = masked out) replaces it, e.g. the block-diagonal causal mask of packed sequences
(aligner.data.packing); with a mask, grouped KV heads are expanded first, because the memory-efficient SDPA kernel
takes a mask but not `enable_gqa` (the math fallback would materialise the full score matrix).
"""

from __future__ import annotations

import math

import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide


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
    ):
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

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPAttention: THD packed sequences and attention bias are not supported (pack with an attention_mask)"
            )
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
