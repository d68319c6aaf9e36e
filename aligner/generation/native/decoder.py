"""The native engine's forward pass: megatron's GPT maths over the engine's weights and a preallocated KV cache.

It computes what megatron-core's GPTModel computes (local layer spec), op for op where it matters for numerics:
- Llama family: RMSNorm, RoPE as megatron applies it (non-interleaved: rotate_half, cos/sin of position x inv_freq
  in float32 cast to the activation dtype), grouped-query attention with linear_qkv grouped per KV group, SwiGLU
  (fc1 = [gate; up]), no biases except an optional qkv bias; GPT-2 family: LayerNorm, learned absolute positions,
  GELU (tanh), biases everywhere.
- Tensor parallelism as in training: vocab-parallel embedding (masked lookup, all-reduce), column-parallel qkv/fc1,
  row-parallel proj/fc2 followed by an all-reduce over megatron's TP group, then the row bias; vocab-parallel
  output layer. `gather_vocab` all-gathers the last position's logits ([B, V/TP] per step, small) so every rank
  samples from identical full-vocabulary logits; megatron's padding columns are dropped there.

Sequences are right-padded and keep their natural positions: sample b's prompt occupies cache slots
[0, len_b), its k-th generated token slot len_b + k. Prefill runs the padded prompts causally (padding sits after
every real token, so no real token sees it) and writes K/V for all prompt slots; slots past len_b hold padding
until decoding overwrites them, and decode masks every key past a sample's own position.
KV cache: one tensor [layers, 2 (K, V), max_batch, KV groups / TP, max_prompt + max_response, head_dim], allocated
once (or again after `free_kv`); decode attends over its first `kv_len` slots (a multiple of kv_block) through
strided views, never copying or reallocating it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class Layout:
    """Shapes and family of the model on this TP rank."""

    arch: str  # llama | gpt2
    num_layers: int
    hidden: int
    heads: int  # query heads on this rank
    groups: int  # KV groups on this rank
    head_dim: int
    vocab_size: int  # real (unpadded) vocabulary
    vocab_local: int  # padded vocabulary slice of this rank
    tp: int
    tp_rank: int
    norm_eps: float
    rotary_base: float

    @property
    def gated(self) -> bool:
        return self.arch == "llama"


class Decoder:
    def __init__(self, layout: Layout, weights, tp_group, max_batch: int, max_seq: int, kv_dtype: torch.dtype,
                 device: torch.device, decode_attention: str = "matmul"):
        self.lo, self.w, self.group = layout, weights, tp_group
        self.max_batch, self.max_seq, self.kv_dtype, self.device = max_batch, max_seq, kv_dtype, device
        self.decode_attention = decode_attention
        self.scale = layout.head_dim ** -0.5
        self.kv: torch.Tensor | None = None
        self.alloc_kv()
        self.key_index = torch.arange(max_seq, device=device)
        self.rows = torch.arange(max_batch, device=device)
        if layout.arch == "llama":
            # megatron's RotaryEmbedding: inv_freq and the angles in float32, cos/sin cast to the activation dtype.
            d = layout.head_dim
            inv_freq = 1.0 / (layout.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
            freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32, device=device), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos = torch.cos(emb).to(weights.dtype)
            self.sin = torch.sin(emb).to(weights.dtype)

    # -- KV cache ------------------------------------------------------------------------------------------
    def alloc_kv(self) -> None:
        lo = self.lo
        # Zeros, not empty: decode reads slots past a sample's position with weight exactly 0, and 0 * NaN (what
        # uninitialised memory may hold) would still be NaN. Slots are only ever overwritten with finite K/V after.
        self.kv = torch.zeros((lo.num_layers, 2, self.max_batch, lo.groups, self.max_seq, lo.head_dim),
                              dtype=self.kv_dtype, device=self.device)

    def free_kv(self) -> None:
        self.kv = None

    def kv_bytes_per_token(self) -> int:
        lo = self.lo
        return lo.num_layers * 2 * lo.groups * lo.head_dim * torch.finfo(self.kv_dtype).bits // 8

    # -- pieces --------------------------------------------------------------------------------------------
    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.lo.tp > 1:
            dist.all_reduce(x, group=self.group)
        return x

    @staticmethod
    def _linear(x, weight, bias=None):
        # matmul then bias, as megatron's parallel linears do (not a fused addmm: same rounding as training)
        y = torch.matmul(x, weight.t())
        return y if bias is None else y + bias

    def _norm(self, x, weight, bias):
        if self.lo.arch == "llama":
            return F.rms_norm(x, (x.shape[-1],), weight, self.lo.norm_eps)
        return F.layer_norm(x, (x.shape[-1],), weight, bias, self.lo.norm_eps)

    def _embed(self, tokens, positions):
        lo, weight = self.lo, self.w.get("embedding.word_embeddings.weight")
        if lo.tp == 1:
            x = F.embedding(tokens, weight)
        else:
            local = tokens - lo.tp_rank * lo.vocab_local
            outside = (local < 0) | (local >= lo.vocab_local)
            x = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0.0)
            x = self._all_reduce(x)
        pos_table = self.w.get("embedding.position_embeddings.weight")
        if pos_table is not None:
            x = x + F.embedding(positions, pos_table)
        return x

    @staticmethod
    def _rope(t, cos, sin):
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-t2, t1), dim=-1) * sin

    def _split_qkv(self, qkv):
        """[..., G*(r+2)*D] -> q [..., G, r, D], k [..., G, D], v [..., G, D] (megatron's per-group order)."""
        lo = self.lo
        r = lo.heads // lo.groups
        qkv = qkv.view(*qkv.shape[:-1], lo.groups, r + 2, lo.head_dim)
        return qkv[..., :r, :], qkv[..., r, :], qkv[..., r + 1, :]

    def _mlp(self, x, lw):
        h = self._linear(x, lw["mlp.linear_fc1.weight"], lw["mlp.linear_fc1.bias"])
        if self.lo.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        out = self._all_reduce(self._linear(h, lw["mlp.linear_fc2.weight"]))
        bias = lw["mlp.linear_fc2.bias"]
        return out if bias is None else out + bias

    def _layer(self, i, x, attend):
        lw = self.w.layer(i)
        h = self._norm(x, lw["input_layernorm.weight"], lw["input_layernorm.bias"])
        qkv = self._linear(h, lw["self_attention.linear_qkv.weight"], lw["self_attention.linear_qkv.bias"])
        attn = self._all_reduce(self._linear(attend(i, qkv), lw["self_attention.linear_proj.weight"]))
        if lw["self_attention.linear_proj.bias"] is not None:
            attn = attn + lw["self_attention.linear_proj.bias"]
        x = x + attn
        h = self._norm(x, lw["pre_mlp_layernorm.weight"], lw["pre_mlp_layernorm.bias"])
        return x + self._mlp(h, lw)

    def _logits_local(self, x_BH):
        x_BH = self._norm(x_BH, self.w.get("decoder.final_layernorm.weight"), self.w.get("decoder.final_layernorm.bias"))
        return self._linear(x_BH, self.w.output_weight)

    # -- prefill -------------------------------------------------------------------------------------------
    def prefill(self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """Run right-padded prompts into cache rows [row0, row0+B); logits of each last prompt token [B, V_pad/TP]."""
        B, T = tokens_BT.shape
        lo, kv = self.lo, self.kv
        positions = self.key_index[:T]
        x = self._embed(tokens_BT, positions.unsqueeze(0))

        def attend(i, qkv):
            q, k, v = self._split_qkv(qkv)  # q [B,T,G,r,D], k/v [B,T,G,D]
            q = q.reshape(B, T, lo.heads, lo.head_dim)
            if lo.arch == "llama":
                cos, sin = self.cos[:T].unsqueeze(1), self.sin[:T].unsqueeze(1)  # [T,1,D]
                q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            k_BGTD, v_BGTD = k.transpose(1, 2), v.transpose(1, 2)
            kv[i, 0, row0:row0 + B, :, :T] = k_BGTD
            kv[i, 1, row0:row0 + B, :, :T] = v_BGTD
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k_BGTD, v_BGTD, is_causal=True, scale=self.scale,
                                                 enable_gqa=lo.heads != lo.groups)
            return out.transpose(1, 2).reshape(B, T, lo.heads * lo.head_dim)

        for i in range(lo.num_layers):
            x = self._layer(i, x, attend)
        last = x[self.rows[:B], lengths_B - 1]  # [B, H]; the final norm is per token, so select first
        return self._logits_local(last)

    # -- decode --------------------------------------------------------------------------------------------
    def decode(self, tokens_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int) -> torch.Tensor:
        """One token per sample at position pos_B (written into the cache); attends over slots [0, kv_len) masked
        to <= pos_B. Returns logits [B, V_pad/TP]. No host syncs, static shapes: safe to capture in a CUDA graph."""
        B = tokens_B.shape[0]
        lo, kv = self.lo, self.kv
        x = self._embed(tokens_B, pos_B)
        r = lo.heads // lo.groups
        beyond_B11L = (self.key_index[:kv_len].unsqueeze(0) > pos_B.unsqueeze(1)).view(B, 1, 1, kv_len)
        slot = pos_B.view(B, 1, 1, 1).expand(B, lo.groups, 1, lo.head_dim)
        if lo.arch == "llama":
            cos, sin = self.cos[pos_B].unsqueeze(1), self.sin[pos_B].unsqueeze(1)  # [B,1,D]

        def attend(i, qkv):
            q, k, v = self._split_qkv(qkv)  # q [B,G,r,D], k/v [B,G,D]
            if lo.arch == "llama":
                q, k = self._rope(q, cos.unsqueeze(1), sin.unsqueeze(1)), self._rope(k, cos, sin)
            k_cache, v_cache = kv[i, 0, :B], kv[i, 1, :B]
            k_cache.scatter_(2, slot, k.unsqueeze(2).to(kv.dtype))
            v_cache.scatter_(2, slot, v.unsqueeze(2).to(kv.dtype))
            keys, values = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]  # [B,G,L,D] strided views
            if self.decode_attention == "sdpa":
                out = F.scaled_dot_product_attention(q.reshape(B, lo.heads, 1, lo.head_dim).to(kv.dtype), keys, values,
                                                     attn_mask=~beyond_B11L, scale=self.scale,
                                                     enable_gqa=lo.heads != lo.groups)
                return out.reshape(B, lo.heads * lo.head_dim).to(qkv.dtype)
            # GQA without repeating K/V: each group's r query heads form the rows of one small GEMM.
            scores = torch.matmul(q.to(kv.dtype), keys.transpose(-1, -2)).float() * self.scale  # [B,G,r,L]
            probs = torch.softmax(scores.masked_fill(beyond_B11L, float("-inf")), dim=-1).to(values.dtype)
            return torch.matmul(probs, values).reshape(B, lo.groups * r * lo.head_dim).to(qkv.dtype)

        for i in range(lo.num_layers):
            x = self._layer(i, x, attend)
        return self._logits_local(x)

    # -- vocabulary ----------------------------------------------------------------------------------------
    def gather_vocab(self, logits_local_BV: torch.Tensor) -> torch.Tensor:
        """Full, unpadded float32 logits [B, V] on every TP rank."""
        lo = self.lo
        if lo.tp > 1:
            B = logits_local_BV.shape[0]
            gathered = logits_local_BV.new_empty((lo.tp * B, lo.vocab_local))
            dist.all_gather_into_tensor(gathered, logits_local_BV.contiguous(), group=self.group)
            logits_local_BV = gathered.view(lo.tp, B, lo.vocab_local).transpose(0, 1).reshape(B, -1)
        return logits_local_BV[:, :lo.vocab_size].float()
