"""The native engine's forward pass: megatron's GPT maths over the engine's weights and a preallocated KV cache.

It computes what megatron-core's GPTModel computes (local layer spec), op for op where it matters for numerics,
from the family's traits (aligner.families): RMSNorm or LayerNorm; optional per-head q/k norms (Qwen3: megatron's
q_layernorm/k_layernorm over each head's width, before RoPE); RoPE as megatron applies it (non-interleaved:
rotate_half, cos/sin of position x inv_freq in float32 cast to the activation dtype, with the policy model's own
inv_freq, so plain and llama3-scaled RoPE alike) or learned absolute positions; grouped-query attention with
linear_qkv grouped per KV group and any head width (Qwen3's head_dim); a gated MLP (fc1 = [gate; up],
act(gate) * up: SwiGLU) or a plain one; a bias wherever the weights carry one (Llama: none but Qwen2's qkv bias,
GPT-2: everywhere).
- Tensor parallelism as in training: vocab-parallel embedding (masked lookup, all-reduce), column-parallel qkv/fc1,
  row-parallel proj/fc2 followed by an all-reduce over megatron's TP group, then the row bias; vocab-parallel
  output layer. `gather_vocab` all-gathers the last position's logits ([B, V/TP] per step, small) so every rank
  samples from identical full-vocabulary logits; megatron's padding columns are dropped by the token choice.

Sequences are right-padded and keep their natural positions: sample b's prompt occupies cache slots
[0, len_b), its k-th generated token slot len_b + k. Prefill runs the padded prompts causally (padding sits after
every real token, so no real token sees it) and writes K/V for all prompt slots; slots past len_b hold padding
until decoding overwrites them, and decode masks every key past a sample's own position.
KV cache: one tensor, allocated once (or again after `free_kv`), never copied or reallocated; decode attends over
its first `kv_len` slots (a multiple of kv_block) through strided views. Its layout follows the decode attention:
- `matmul` (group-major) [layers, 2 (K, V), max_batch, KV groups / TP, max_seq, head_dim]: each sample's group is one
  [kv_len, head_dim] matrix, the operand of a batched GEMM;
- `sdpa` and `flash` (sequence-major) [layers, 2, max_batch, max_seq, KV groups / TP, head_dim]: a layer's K (or V)
  is the packed [max_batch x max_seq, groups, head_dim] tensor of a variable-length attention kernel, sample b's
  keys starting at row b x max_seq. `flash` is PyTorch's FlashAttention-2 forward in its variable-length form with
  `seqused_k` (b's first pos_b + 1 keys): it reads only the filled slots and handles GQA itself (CUDA only, probed
  at build); on the H200 it ran slower than `matmul` (PyTorch's build picks its prefill kernel, not a split-KV
  decode kernel: docs/PERF.md).
- `triton` (group-major, as `matmul`): one Triton kernel per layer (triton_decode.py) reads each sample's filled
  slots [0, pos_b] only, whatever `kv_len` says: no mask, no padding read, one CUDA graph for every step of a call.
  Up to FUSED_WRITE_MAX_BATCH it also writes the step's key and value, and then (no q/k norms) applies RoPE to q and
  the key itself, from the qkv projection's rows: no RoPE or scatter kernel in the step. An FP8 cache (triton only)
  holds each layer's values in chunks of triton_decode.V_CHUNK slots ([G, slots / C, head_dim, C] per sample, in
  the storage of the layer's [G, slots, head_dim] values: `values`), the kernel's faster layout for the FP8 product.
Split-K GEMMs (`decode_gemm="splitk"`, splitk.py, TP=1): decode steps of up to splitk.MAX_BATCH rows run the
row-parallel projections (proj, fc2) as one Triton kernel each whose float32 partial sums the next compiled kernel
(residual add and norm) adds up, and a SwiGLU MLP's fc1 together with its activation as one kernel; cuBLAS everywhere
else (prefill, qkv, the output layer, larger batches).
FP8 decode weights (`decode_fp8`, fp8.py): decode steps run fc1, fc2 and the output layer as FP8 GEMMs, their inputs
quantized per row by the compiled kernel before and their results scaled by the one after (Kernels.*_q, dq*); with
split-K GEMMs a SwiGLU fc1, its scales and the activation are one Triton kernel (splitk.gated_matmul_fp8), fc2
runs by the split-K kernel on e4m3 operands (splitk.matmul_fp8), and qkv and the output layer by that kernel in one
K range, writing the engine's dtype (every norm before qkv then quantizes its output); with RMSNorm the norms after
the split-K GEMMs and the activation's quantization are row kernels (rows.py). Decode steps above the kernels' row
limits run the output layer (and qkv above splitk.ROW_BLOCKS_MAX_BATCH) by cuBLAS's row-wise scaled FP8 GEMM
(fp8.matmul_rowwise: scales in its epilogue), fc2 and proj by cuBLAS; fc1 with its activation and qkv stay on the
Triton kernels, in blocks of splitk.ROW_BLOCK rows, up to splitk.ROW_BLOCKS_MAX_BATCH rows. Prefill runs its MLPs
on the same FP8 copies by cuBLAS, and qkv where the copies include it (by the row-wise scaled FP8 GEMM).
Prefill's last layer runs proj, its MLP and the final norm on each prompt's last position only (PREFILL_LAST_ONLY):
the cache needs every layer's keys and values, the output layer the last position's hidden state, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from aligner.families import FamilySpec
from aligner.generation.native import fp8, pdl, rows, splitk, triton_decode
from aligner.generation.native.fused import make_kernels

# Prefill's last layer runs proj and the MLP on each prompt's last position only (Decoder._stack's `pick`); False
# runs them on every position, as before (probes compare the two: --set decoder.PREFILL_LAST_ONLY=False).
PREFILL_LAST_ONLY = True


def _qk_norms(lw: dict) -> tuple:
    """A layer's per-head q/k norm weights and biases (None where absent), as rope_split takes them."""
    return (
        lw["self_attention.q_layernorm.weight"],
        lw["self_attention.q_layernorm.bias"],
        lw["self_attention.k_layernorm.weight"],
        lw["self_attention.k_layernorm.bias"],
    )


@dataclass(frozen=True)
class Layout:
    """Shapes and family of the model on this TP rank."""

    family: FamilySpec
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
    qk_norm: bool  # per-head q/k norms (megatron's qk_layernorm)


class Decoder:
    def __init__(
        self,
        layout: Layout,
        weights,
        tp_group,
        max_batch: int,
        max_seq: int,
        kv_dtype: torch.dtype,
        device: torch.device,
        decode_attention: str = "matmul",
        compile_elementwise: bool = False,
        inv_freq: torch.Tensor | None = None,
        decode_fp8: fp8.DecodeFp8 | None = None,
        decode_gemm: str = "cublas",
        softmax_scale: float | None = None,
        passed_scale: float | None = None,
        nope_layers=(),
    ):
        """`inv_freq` [rotated width / 2] float32: RoPE's frequencies, those of the policy model (rope families).
        `softmax_scale`: the attention's logit scale, the policy's (None: 1 / sqrt(head width)). `inv_freq` may rotate
        fewer channels than the head has (rotary_percent < 1): the rest pass through, times `passed_scale` where set
        (aligner.models.rope.passed_channel_scale), as the cos of the RoPE tables.
        `decode_fp8`: FP8 copies of the MLP and output weights, read by decode steps (fp8.py).
        `decode_gemm`: "splitk" runs decode's row-parallel projections with the split-K kernel (TP=1 only).
        `nope_layers`: layers (0-based) that attend without RoPE (SmolLM3): their tables are the identity rotation."""
        if decode_gemm == "splitk" and layout.tp > 1:
            raise ValueError("the split-K decode GEMMs need TP=1 (their partial sums are not reduced over ranks)")
        self.lo, self.w, self.group = layout, weights, tp_group
        self.fp8, self.decode_gemm = decode_fp8, decode_gemm
        self.max_batch, self.max_seq, self.kv_dtype, self.device = max_batch, max_seq, kv_dtype, device
        self.decode_attention = decode_attention
        # the FP8 split-K kernels' tilings keep their programs in one wave on this GPU (splitk.one_wave; None: CPU)
        self.sms, self.sm_shared = None, splitk.SM_SHARED
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            self.sms = props.multi_processor_count
            self.sm_shared = getattr(props, "shared_memory_per_multiprocessor", None) or splitk.SM_SHARED
        # An FP8 cache (kv_dtype float8_e4m3fn): e4m3 keys and values with a float32 scale per (slot, group), read and
        # written by the Triton decode kernel only; prefill quantizes what it writes and its own attention reads them
        # as the cache holds them. Its values lie in chunks of triton_decode.V_CHUNK slots (the kernel's faster
        # layout; `values`), so its slots are max_seq rounded up to whole chunks.
        self.kv_fp8 = kv_dtype == triton_decode.FP8
        if self.kv_fp8 and decode_attention != "triton":
            raise ValueError(f"an FP8 KV cache is read by the Triton decode attention only, not by {decode_attention}")
        chunk = triton_decode.V_CHUNK
        self.cache_slots = -(-max_seq // chunk) * chunk if self.kv_fp8 else max_seq
        self.kv_scale: torch.Tensor | None = None
        self.seq_major = decode_attention in ("sdpa", "flash")  # the cache layout (module docstring)
        self.scale = layout.head_dim**-0.5 if softmax_scale is None else softmax_scale
        # Compiled kernels (compile_elementwise): decode's for its fixed shapes per batch size (captured in the CUDA
        # graphs), prefill's for any batch and prompt width (compiled once with symbolic shapes).
        fam, eps, qk_norm = layout.family, layout.norm_eps, layout.qk_norm
        self.rotated = None if inv_freq is None else 2 * inv_freq.shape[0]  # RoPE's channels of a head
        rot = self.rotated
        self.k = make_kernels(fam, eps, compile_elementwise, qk_norm, max_batch=max_batch, rotated=rot)
        # decode steps of up to pdl.MAX_BATCH rows: the same kernels compiled for programmatic dependent launch
        self.k_pdl = self.k
        if compile_elementwise and pdl.inductor_options(device):
            self.k_pdl = make_kernels(
                fam, eps, True, qk_norm, max_batch=max_batch, pdl_device=torch.device(device), rotated=rot
            )
        self.k_prefill = make_kernels(fam, eps, compile_elementwise, qk_norm, prefill=True, rotated=rot)
        if decode_fp8 is not None and decode_gemm == "splitk" and fam.normalization == "RMSNorm":
            # After the Triton GEMMs, the add+norm+quantize and the activation's quantization by one-program-per-row
            # Triton kernels (rows.py: faster than the compiled looped reductions at these widths)
            def add_parts_norm_q(x, parts, bias, w, b):
                return rows.add_parts_norm(x, parts, bias, w, eps, quantize=True)

            row_kernels = dict(add_parts_norm_q=add_parts_norm_q, q=lambda m: rows.quantize_rows(m))
            self.k, self.k_pdl = replace(self.k, **row_kernels), replace(self.k_pdl, **row_kernels)
        self.kv: torch.Tensor | None = None
        self.alloc_kv()
        self.key_index = torch.arange(max_seq, device=device)
        self.rows = torch.arange(max_batch, device=device)
        # per row: the row whose cache holds its prompt's slots [0, shared_B) too (a group's first row, <= the row;
        # the row itself where no row above has its prompt): read there by the Triton kernel with SHARED_PREFIX
        self.lead_B = self.rows.clone()
        self.shared_B = torch.zeros(max_batch, dtype=torch.long, device=device)
        # ... and triton_decode.GROUP_PREFIX's chunks of a group's rows (triton_decode.group_chunks): per row, where
        # its own steps start (-1: all of them); per chunk (first row, rows, prompt length), [max_batch // 2, 3]
        self.from_B = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.chunks = torch.zeros((max(max_batch // 2, 1), 3), dtype=torch.int32, device=device)
        self.cu_rows = torch.arange(max_batch + 1, device=device, dtype=torch.int32)  # flash's cumulative offsets
        self.cos = self.sin_signed = None
        if layout.family.rope:
            # megatron's RotaryEmbedding: the angles in float32, cos/sin cast to the activation dtype.
            if inv_freq is None or inv_freq.dim() != 1 or not 0 < inv_freq.shape[0] <= layout.head_dim // 2:
                raise ValueError(f"a RoPE model needs inv_freq of shape (n,), n <= {layout.head_dim // 2}")
            inv_freq = inv_freq.to(device=device, dtype=torch.float32)
            freqs = torch.outer(torch.arange(max_seq, dtype=torch.float32, device=device), inv_freq)
            # channels past the rotated ones: cos 1 (or the passed channels' scale) and sin 0, so the same kernels
            # pass them through
            rest = torch.ones(max_seq, layout.head_dim - self.rotated, device=device)
            passed = rest * (1.0 if passed_scale is None else passed_scale)
            self.cos = torch.cos(torch.cat((freqs, freqs), dim=-1))
            self.cos = torch.cat((self.cos, passed), dim=-1).to(weights.dtype)
            self.sin_signed = torch.sin(torch.cat((-freqs, freqs), dim=-1))  # [-sin, sin]
            self.sin_signed = torch.cat((self.sin_signed, 0 * rest), dim=-1).to(weights.dtype)
        # Layers without RoPE (SmolLM3's NoPE layers) take tables of cos 1 and sin 0 at every position: the same
        # kernels, with q and k passed through exactly (t * 1 + t' * 0 = t). Position-free, so their rows serve
        # any prompt width or batch.
        self.nope = frozenset(nope_layers)
        self.cos_id = self.sin_id = None
        if self.nope and self.cos is not None:
            self.cos_id = torch.ones(max(max_seq, max_batch), layout.head_dim, device=device, dtype=weights.dtype)
            self.sin_id = torch.zeros_like(self.cos_id)

    # -- KV cache ------------------------------------------------------------------------------------------
    def alloc_kv(self) -> None:
        lo = self.lo
        # Zeros, not empty: decode reads slots past a sample's position with weight exactly 0, and 0 * NaN (what
        # uninitialised memory may hold) would still be NaN. Slots are only ever overwritten with finite K/V after.
        per_sample = (self.cache_slots, lo.groups) if self.seq_major else (lo.groups, self.cache_slots)
        self.kv = torch.zeros(
            (lo.num_layers, 2, self.max_batch, *per_sample, lo.head_dim), dtype=self.kv_dtype, device=self.device
        )
        if self.kv_fp8:  # each (slot, group)'s key and value scale (triton_decode.quantize_fp8), group-major
            self.kv_scale = torch.zeros(
                (lo.num_layers, 2, self.max_batch, lo.groups, self.cache_slots), dtype=torch.float32, device=self.device
            )

    def values(self, i: int, rows: slice) -> torch.Tensor:
        """An FP8 cache's values of layer i for cache rows `rows`: [rows, G, slots / C, D, C] in chunks of C =
        triton_decode.V_CHUNK slots (a view: the layer's [2, max_batch, G, slots, D] storage holds them so)."""
        lo, C = self.lo, triton_decode.V_CHUNK
        return self.kv[i, 1].view(self.max_batch, lo.groups, self.cache_slots // C, lo.head_dim, C)[rows]

    def copy_cache_rows(self, source_B: torch.Tensor, slots: int) -> None:
        """Cache rows [0, B) take the first `slots` slots of each layer's keys and values (and an FP8 cache's scales:
        whole chunks of values) from rows `source_B` (each gathered first, so a source may be a destination too)."""
        B, C = source_B.numel(), triton_decode.V_CHUNK
        for i in range(self.lo.num_layers):
            if self.seq_major:  # [2, rows, slots, G, D]
                self.kv[i, :, :B, :slots] = self.kv[i, :, source_B, :slots]
            elif self.kv_fp8:  # e4m3 moved as bytes (indexing kernels need not know float8 types)
                keys, values = self.kv[i, 0].view(torch.uint8), self.values(i, slice(None)).view(torch.uint8)
                scales = self.kv_scale[i]
                keys[:B, :, :slots] = keys[source_B, :, :slots]
                chunks = -(-slots // C)
                values[:B, :, :chunks] = values[source_B, :, :chunks]
                scales[:, :B, :, :slots] = scales[:, source_B, :, :slots]
            else:  # [2, rows, G, slots, D]
                self.kv[i, :, :B, :, :slots] = self.kv[i, :, source_B, :, :slots]

    def set_prompt_groups(self, new_prompt_B: torch.Tensor | None, lengths_B: torch.Tensor) -> None:
        """This call's groups: rows where `new_prompt_B` is False repeat the prompt of the row above (their cache
        slots [0, length) copied: copy_cache_rows); None: no row repeats one."""
        B = lengths_B.numel()
        self.from_B.fill_(-1)
        self.chunks.zero_()
        if new_prompt_B is None:
            self.lead_B[:B].copy_(self.rows[:B])
            self.shared_B[:B].zero_()
            return
        self.lead_B[:B] = torch.cummax(torch.where(new_prompt_B, self.rows[:B], 0), dim=0).values
        self.shared_B[:B] = lengths_B
        per_chunk = triton_decode.group_rows(self.lo.heads // self.lo.groups)
        if per_chunk >= 2:
            from_B, chunks = triton_decode.group_chunks(self.lead_B[:B], lengths_B, per_chunk)
            self.from_B[:B], self.chunks[: B // 2] = from_B, chunks

    def kv_ptrs(self) -> tuple[int, ...]:
        """Where the cache (and an FP8 cache's scales) lie: the addresses captured graphs read."""
        return tuple(t.data_ptr() for t in (self.kv, self.kv_scale) if t is not None)

    def free_kv(self) -> None:
        self.kv = self.kv_scale = None

    def kv_bytes_per_token(self) -> int:
        lo = self.lo
        per_row = lo.head_dim * torch.finfo(self.kv_dtype).bits // 8 + (4 if self.kv_fp8 else 0)
        return lo.num_layers * 2 * lo.groups * per_row

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

    def _qkv5(self, qkv):
        """[..., G*(r+2)*D] -> [..., G, r+2, D]: megatron's per-group order (the group's query heads, key, value)."""
        lo = self.lo
        return qkv.view(*qkv.shape[:-1], lo.groups, lo.heads // lo.groups + 2, lo.head_dim)

    def _row_parallel(self, x, weight, split_k: bool):
        """A row-parallel projection without its bias: (x @ W^T reduced over TP, False), or with `split_k` where the
        kernel has a tiling for W, (its float32 partial sums, True) for an add_parts_norm kernel."""
        tiling = self._one_wave(splitk.tiling_for(x.shape[0], *weight.shape), x, weight) if split_k else None
        if tiling is None:
            return self._all_reduce(self._linear(x, weight)), False
        return splitk.matmul(x, weight, tiling), True

    def _stack(
        self,
        x,
        attend,
        k,
        q8: fp8.DecodeFp8 | None = None,
        split_k: bool = False,
        fp8_output: bool = True,
        pick=None,
    ):
        """All layers over hidden states x [..., H] with kernels `k`; returns the final-normed hidden states (with
        `q8`, FP8 weights: the MLPs on their FP8 copies, and with `fp8_output` the result quantized per row, (h8,
        scales), for the FP8 output layer). `split_k`: proj and fc2
        by the split-K kernel where it has a tiling for them (decode steps of x [B, H]: splitk.tiling_for); with `q8`
        holding qkv copies, also qkv on FP8 tensor cores (its input norms then quantize their outputs).
        `pick(t)`: the positions whose final hidden states are read (prefill: each prompt's last), taken from the
        last layer's attention output and residual stream; that layer's proj and MLP run on them alone (every other
        position's last-layer output is never read, and the cache needs only the layers' qkv).

        Each residual add is fused with the norm that follows it (the next layer's input norm, or the final norm).
        """
        lo = self.lo
        lw = self.w.layer(0)
        qkv_tiling = self._fp8_qkv_tiling(x, q8, split_k)
        # qkv on its FP8 copy where the copies include it: by the split-K kernel (decode steps with a tiling) or by
        # cuBLAS's row-wise scaled FP8 GEMM (prefill: [B, T, H], and decode steps above
        # splitk.ROW_BLOCKS_MAX_BATCH rows: compute-bound there, the FP8 tensor cores' rate); else in the engine's dtype
        qkv_fp8 = q8 is not None and q8.has_qkv and (qkv_tiling is not None or fp8.rowwise_writes(x.dtype, x.device))
        h = (k.norm_q if qkv_fp8 else k.norm)(x, lw["input_layernorm.weight"], lw["input_layernorm.bias"])
        for i in range(lo.num_layers):
            lw = self.w.layer(i)
            qkv = self._qkv(h, i, lw, q8 if qkv_fp8 else None, qkv_tiling)
            o = attend(i, qkv, lw)
            if pick is not None and i + 1 == lo.num_layers:
                o, x = pick(o), pick(x)
            a, parts = self._row_parallel(o, lw["self_attention.linear_proj.weight"], split_k)
            pre_mlp = (
                lw["self_attention.linear_proj.bias"],
                lw["pre_mlp_layernorm.weight"],
                lw["pre_mlp_layernorm.bias"],
            )
            if i + 1 < lo.num_layers:
                nxt = self.w.layer(i + 1)
                post_mlp = (lw["mlp.linear_fc2.bias"], nxt["input_layernorm.weight"], nxt["input_layernorm.bias"])
            else:
                final = (self.w.get("decoder.final_layernorm.weight"), self.w.get("decoder.final_layernorm.bias"))
                post_mlp = (lw["mlp.linear_fc2.bias"], *final)
            if q8 is not None:
                x, h8, hs = (k.add_parts_norm_q if parts else k.add_norm_q)(x, a, *pre_mlp)
                # quantized for the next FP8 qkv or the FP8 output layer
                last = i + 1 == lo.num_layers
                quantize_h = fp8_output if last else qkv_fp8
                x, h = self._mlp_fp8(x, h8, hs, i, lw, k, q8, post_mlp, split_k, quantize_h)
                continue
            x, h = (k.add_parts_norm if parts else k.add_norm)(x, a, *pre_mlp)
            m = self._fc1_act(h, lw, k, split_k)
            m, parts = self._row_parallel(m, lw["mlp.linear_fc2.weight"], split_k)
            x, h = (k.add_parts_norm if parts else k.add_norm)(x, m, *post_mlp)
        return h

    def _qk_norm_in_kernel(self) -> bool:
        """Whether the Triton decode kernel norms q and the new key itself (triton_decode.QK_NORM): per-head RMSNorms
        without bias, before RoPE, with weights in the engine's dtype."""
        q_w, q_b, k_w, k_b = _qk_norms(self.w.layer(0))
        return (
            triton_decode.QK_NORM
            and self.decode_attention == "triton"
            and self.lo.qk_norm
            and self.lo.family.normalization == "RMSNorm"
            and self.cos is not None
            and all(w is not None and w.dtype == self.w.dtype for w in (q_w, k_w))
            and q_b is None
            and k_b is None
        )

    def _fp8_qkv_tiling(self, x, q8: fp8.DecodeFp8 | None, split_k: bool) -> splitk.Tiling | None:
        """The tiling of an FP8 qkv (splitk.matmul_fp8 in one K range) for a decode step of x [B, H], where the FP8
        decode weights include qkv and split-K GEMMs run (None: qkv in the engine's dtype)."""
        if q8 is None or not q8.has_qkv or not split_k or x.dim() != 2:
            return None
        w8 = q8.layer(0, "qkv")[0]
        return self._one_wave(splitk.fp8_product_tiling_for(x.shape[0], *w8.shape, row_blocks=True), x, w8)

    def _one_wave(self, tiling: splitk.Tiling | None, x, weight, gated: bool = False) -> splitk.Tiling | None:
        """`tiling` for x [B, K] and `weight` with its stages fitted to this GPU (splitk.one_wave): the FP8 kernels'
        to one wave of programs (measured faster at the 8B shape); the 16-bit ones only where a program would not
        fit a multiprocessor at all (fewer stages gained them nothing: docs/PERF.md)."""
        rows, nbytes = weight.shape[0], weight.element_size()
        waves = nbytes == 1
        return splitk.one_wave(tiling, x.shape[0], rows, nbytes, self.sms, gated, self.sm_shared, waves)

    def _qkv(self, h, i, lw, q8, tiling):
        """Layer i's qkv projection from its normed input h, or with `q8` from h quantized, (h8, scales), on its
        e4m3 copy (the product rounded once to the engine's dtype): by the split-K kernel with `tiling`, else by
        cuBLAS's row-wise scaled FP8 GEMM; then the bias, if any."""
        w, b = lw["self_attention.linear_qkv.weight"], lw["self_attention.linear_qkv.bias"]
        if q8 is None:
            return self._linear(h, w, b)
        h8, hs = h
        if tiling is not None:
            y = splitk.matmul_fp8(h8, hs, *q8.layer(i, "qkv"), tiling, self.w.dtype)
        else:
            y = fp8.matmul_rowwise(h8, hs, *q8.layer(i, "qkv"), self.w.dtype)
        return y if b is None else y + b

    def _fc1_act(self, h, lw, k, split_k: bool):
        """fc1 and its activation; with `split_k`, a SwiGLU MLP without fc1 bias (Llama, Qwen) runs both as one
        Triton kernel (splitk.gated_matmul) where it has a tiling for the step's rows."""
        w, b = lw["mlp.linear_fc1.weight"], lw["mlp.linear_fc1.bias"]
        fam = self.lo.family
        swiglu = fam.gated_mlp and fam.activation == "silu" and b is None
        tiling = None
        if split_k and swiglu and h.dim() == 2:
            tiling = self._one_wave(splitk.gated_tiling_for(h.shape[0], *w.shape), h, w, gated=True)
        if tiling is None:
            return k.act(self._linear(h, w, b))
        return splitk.gated_matmul(h, w, tiling)

    def _mlp_fp8(self, x, h8, hs, i, lw, k, q8, post_mlp, split_k: bool = False, quantize_h: bool = False):
        """Layer i's MLP with FP8 weights (fp8.py) from its normed input quantized (h8, scales), and the residual add
        and norm after it; returns (x, h), h quantized (h8, scales) with `quantize_h` (for the FP8 output layer after
        the last layer, or the next layer's FP8 qkv). With `split_k`, a SwiGLU
        MLP without fc1 bias runs fc1, its scales and the activation as one Triton kernel (splitk.gated_matmul_fp8)
        where it has a tiling for the step's rows, then a kernel quantizing the activation per row; and fc2 runs by
        the split-K kernel on FP8 tensor cores (splitk.matmul_fp8) where it has a tiling."""
        w1, s1 = q8.layer(i, 1)
        fam = self.lo.family
        swiglu = fam.gated_mlp and fam.activation == "silu" and lw["mlp.linear_fc1.bias"] is None
        tiling = None
        if split_k and swiglu and h8.dim() == 2:
            tiling = self._one_wave(splitk.fp8_gated_tiling_for(h8.shape[0], *w1.shape), h8, w1, gated=True)
        if tiling is not None:
            m8, ms = k.q(splitk.gated_matmul_fp8(h8, hs, w1, s1, tiling, x.dtype))
        else:
            # fc1's product in the activation dtype (half the bytes into the activation kernel: measured faster),
            # fc2's in float32 until it joins the residual stream
            y1 = fp8.matmul(h8, w1, q8.one, x.dtype)
            m8, ms = k.act_q(y1, hs, s1, lw["mlp.linear_fc1.bias"], x.dtype)
        w2, s2 = q8.layer(i, 2)
        t2 = self._one_wave(splitk.tiling_for(m8.shape[0], *w2.shape), m8, w2) if split_k and m8.dim() == 2 else None
        if t2 is not None:  # fc2 on FP8 tensor cores by K ranges: float32 partial sums, added by the norm kernel
            parts = splitk.matmul_fp8(m8, ms, w2, s2, t2)
            if not quantize_h:
                return k.add_parts_norm(x, parts, *post_mlp)
            x, h8, hs = k.add_parts_norm_q(x, parts, *post_mlp)
            return x, (h8, hs)
        y = fp8.matmul(m8, w2, q8.one)
        if self.lo.tp > 1:  # row-parallel: each rank's partial sum in its own scales, dequantized before the sum
            m = self._all_reduce(k.dq(y, ms, s2, x.dtype))
            if not quantize_h:
                return k.add_norm(x, m, *post_mlp)
            x, h8, hs = k.add_norm_q(x, m, *post_mlp)
        else:
            if not quantize_h:
                return k.dq_add_norm(x, y, ms, s2, *post_mlp)
            x, h8, hs = k.dq_add_norm_q(x, y, ms, s2, *post_mlp)
        return x, (h8, hs)

    def _tables(self, cos, sin, n: int):
        """Layer i -> its RoPE tables for a call whose tables are `cos` and `sin` ([n, 1, 1, D] or None): those, or
        the identity rotation's first n rows in a layer without RoPE (`nope_layers`)."""
        if self.cos_id is None:
            return lambda i: (cos, sin)
        shape = (n, 1, 1, self.lo.head_dim)
        cos_id, sin_id = self.cos_id[:n].view(shape), self.sin_id[:n].view(shape)
        return lambda i: (cos_id, sin_id) if i in self.nope else (cos, sin)

    # -- prefill -------------------------------------------------------------------------------------------
    def prefill(self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, row0: int = 0) -> torch.Tensor:
        """Run right-padded prompts into cache rows [row0, row0+B); logits of each last prompt token [B, V_pad/TP]."""
        B, T = tokens_BT.shape
        lo, kv = self.lo, self.kv
        x = self._embed(tokens_BT, self.key_index[:T].unsqueeze(0))
        cos = None if self.cos is None else self.cos[:T].view(T, 1, 1, lo.head_dim)
        sin = None if self.cos is None else self.sin_signed[:T].view(T, 1, 1, lo.head_dim)
        tables = self._tables(cos, sin, T)

        def attend(i, qkv, lw):
            # q [B,T,G,r,D] and kv_new [2,B,T,G,D], both contiguous: the [B,H,T,D] operands below are views
            q, kv_new = self.k_prefill.rope_split(self._qkv5(qkv), *tables(i), *_qk_norms(lw))
            kv_2BGTD = kv_new.transpose(2, 3)
            if self.seq_major:
                kv[i, :, row0 : row0 + B, :T] = kv_new
            elif self.kv_fp8:  # the prompt attends to its keys and values as the cache holds them, as decode does
                rows = slice(row0, row0 + B)
                kv_2BGTD = triton_decode.prefill_fp8(
                    kv_new, kv[i, 0, rows], self.values(i, rows), self.kv_scale[i, :, rows]
                )
            else:
                kv[i, :, row0 : row0 + B, :, :T] = kv_2BGTD
            q_BHTD = q.view(B, T, lo.heads, lo.head_dim).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q_BHTD, kv_2BGTD[0], kv_2BGTD[1], is_causal=True, scale=self.scale, enable_gqa=lo.heads != lo.groups
            )
            return out.transpose(1, 2).reshape(B, T, lo.heads * lo.head_dim)

        # FP8 weights: the MLPs by cuBLAS's FP8 GEMMs too (compute-bound here: FP8 tensor cores' rate), and qkv where
        # the copies include it (split-K decode GEMMs); proj and the output layer (one row per prompt) in the
        # engine's dtype
        def last_positions(t):  # [B, T, ...] -> [B, 1, ...]: each prompt's last token (prefill's kernels take 3-D)
            return t[self.rows[:B], lengths_B - 1].unsqueeze(1)

        pick = last_positions if PREFILL_LAST_ONLY else None
        h = self._stack(x, attend, self.k_prefill, self.fp8, fp8_output=False, pick=pick)
        last = h[:, 0] if pick is not None else h[self.rows[:B], lengths_B - 1]  # [B, H]
        return self._linear(last, self.w.output_weight)

    # -- decode --------------------------------------------------------------------------------------------
    def decode(self, tokens_B: torch.Tensor, pos_B: torch.Tensor, kv_len: int, grouped: bool = False) -> torch.Tensor:
        """One token per sample at position pos_B (written into the cache); attends over slots [0, kv_len) masked
        to <= pos_B. Returns logits [B, V_pad/TP]. No host syncs, static shapes: safe to capture in a CUDA graph.
        `grouped`: the call's rows repeat prompts (set_prompt_groups); with the Triton kernel and
        triton_decode.SHARED_PREFIX each row then reads its prompt's slots from its group's first row, and with
        GROUP_PREFIX as well a group program attends a chunk of rows' query rows over those slots at once."""
        B = tokens_B.shape[0]
        lo, kv = self.lo, self.kv
        G, r, D = lo.groups, lo.heads // lo.groups, lo.head_dim
        kernels = self.k_pdl if B <= pdl.MAX_BATCH else self.k
        x = self._embed(tokens_B, pos_B)
        # slots past each sample's position: the mask of the matmul and sdpa paths (triton and flash use pos_B)
        beyond_BL = None
        if self.decode_attention in ("matmul", "sdpa"):
            beyond_BL = self.key_index[:kv_len].unsqueeze(0) > pos_B.unsqueeze(1)
        # The Triton kernel writes the step's key and value itself up to a batch size; elsewhere one scatter per
        # layer does (same-run on one H200, 1B, docs/PERF.md: decode -4 % at B=64; with RoPE in the kernel, -1.9 %
        # at 256 and -1.6 % at 512).
        # (an FP8 cache: at every batch size, quantizing them as it writes)
        kernel_writes = self.decode_attention == "triton" and (B <= triton_decode.FUSED_WRITE_MAX_BATCH or self.kv_fp8)
        # ... and then also applies RoPE to q and the new key itself, reading the qkv projection's rows in place: no
        # RoPE kernel per layer (per-head q/k norms, which run before RoPE: by the kernel too where they are
        # RMSNorms without bias, triton_decode.QK_NORM; not with a cache of another 16/32-bit dtype)
        norms_ok = not lo.qk_norm or self._qk_norm_in_kernel()
        kernel_ropes = kernel_writes and norms_ok and (kv.dtype == self.w.dtype or self.kv_fp8)
        scales = (lambda i: (self.kv_scale[i, 0, :B], self.kv_scale[i, 1, :B])) if self.kv_fp8 else (lambda i: None)
        cached_values = (lambda i: self.values(i, slice(0, B))) if self.kv_fp8 else (lambda i: kv[i, 1, :B])
        slot_dim = 2 if self.seq_major else 3  # of the layer's cache [2, B, ...]
        slot = pos_B.view(1, B, 1, 1, 1).expand(*((2, B, 1, G, D) if self.seq_major else (2, B, G, 1, D)))
        cos = None if self.cos is None else self.cos[pos_B].view(B, 1, 1, D)
        sin = None if self.cos is None else self.sin_signed[pos_B].view(B, 1, 1, D)
        if self.decode_attention == "matmul":
            # additive mask, built once per step for all layers: [B*G, 1, L], broadcast over the r query rows
            mask_add = (
                torch.zeros(B, 1, 1, kv_len, dtype=kv.dtype, device=kv.device)
                .masked_fill_(beyond_BL.view(B, 1, 1, kv_len), float("-inf"))
                .expand(B, G, 1, kv_len)
                .reshape(B * G, 1, kv_len)
            )
        elif self.decode_attention == "triton":
            splits = triton_decode.choose_splits(B * G, self.max_seq, kv.device)
            shared = (self.lead_B[:B], self.shared_B[:B]) if grouped and triton_decode.SHARED_PREFIX else None
            groups = None  # a group's prompt attended once for a chunk of its rows
            by_rows = B >= max(2, triton_decode.GROUP_PREFIX_MIN_BATCH) and triton_decode.group_rows(r) >= 2
            if shared is not None and triton_decode.GROUP_PREFIX and by_rows:
                groups = (self.from_B[:B], self.chunks[: B // 2])
        elif self.decode_attention == "flash":
            T = self.max_seq
            cu_q = self.cu_rows[: B + 1]  # one query row per sample
            cu_k = cu_q * T  # sample b's keys start at row b*T of the packed cache
            used_k = (pos_B + 1).to(torch.int32)

        tables = self._tables(cos, sin, B)

        def rope_BD(i):  # layer i's (cos, sin_signed) rows [B, D] for the Triton kernel's RoPE (None: no RoPE)
            c, s = tables(i)
            return None if c is None else (c.view(B, D), s.view(B, D))

        def qk_norm(lw):  # the per-head q/k norms the kernel applies before its RoPE (with kernel_ropes)
            if not lo.qk_norm:
                return None
            q_w, _, k_w, _ = _qk_norms(lw)
            return q_w, k_w, lo.norm_eps

        def attend(i, qkv, lw):
            if kernel_ropes:  # q, key and value: views of the projection's rows, rotated and written by the kernel
                qkv5 = self._qkv5(qkv)
                out = triton_decode.decode_attention(
                    qkv5[:, :, :r], kv[i, 0, :B], cached_values(i), pos_B, self.scale, splits,
                    new_kv=(qkv5[:, :, r], qkv5[:, :, r + 1]), rope=rope_BD(i), kv_scales=scales(i), shared=shared,
                    groups=groups, qk_norm=qk_norm(lw), rotated=self.rotated,
                )  # fmt: skip
                return out.view(B, lo.heads * D)
            q, kv_new = kernels.rope_split(self._qkv5(qkv), *tables(i), *_qk_norms(lw))  # q [B,G,r,D], kv [2,B,G,D]
            cache = kv[i, :, :B]  # [2, B, T, G, D] (sequence-major) or [2, B, G, T, D]
            if not self.kv_fp8:  # (the kernel quantizes the step's key and value for an FP8 cache)
                kv_new = kv_new.to(kv.dtype)
            if not kernel_writes:
                cache.scatter_(slot_dim, slot, kv_new.unsqueeze(slot_dim))
            if self.decode_attention == "triton":
                new_kv = (kv_new[0], kv_new[1]) if kernel_writes else None
                out = triton_decode.decode_attention(
                    q, cache[0], cached_values(i), pos_B, self.scale, splits, new_kv=new_kv, kv_scales=scales(i),
                    shared=shared, groups=groups,
                )  # fmt: skip
                return out.view(B, lo.heads * D).to(qkv.dtype)
            if self.decode_attention == "flash":
                out = flash_varlen(
                    q.reshape(B, lo.heads, D).to(kv.dtype),
                    cache[0].view(B * self.max_seq, G, D),
                    cache[1].view(B * self.max_seq, G, D),
                    cu_q,
                    cu_k,
                    kv_len,
                    used_k,
                    self.scale,
                )
                return out.reshape(B, lo.heads * D).to(qkv.dtype)
            if self.seq_major:  # [B,G,L,D] strided views, no copies
                keys, values = cache[0, :, :kv_len].transpose(1, 2), cache[1, :, :kv_len].transpose(1, 2)
            else:
                keys, values = cache[0, :, :, :kv_len], cache[1, :, :, :kv_len]
            if self.decode_attention == "sdpa":
                out = F.scaled_dot_product_attention(
                    q.reshape(B, lo.heads, 1, D).to(kv.dtype),
                    keys,
                    values,
                    attn_mask=~beyond_BL.view(B, 1, 1, kv_len),
                    scale=self.scale,
                    enable_gqa=lo.heads != G,
                )
                return out.reshape(B, lo.heads * D).to(qkv.dtype)
            # GQA without repeating K/V: each group's r query heads are the rows of one small GEMM; the scale and
            # the mask ride in baddbmm's epilogue.
            scores = torch.baddbmm(
                mask_add,
                q.reshape(B * G, r, D).to(kv.dtype),
                keys.reshape(B * G, kv_len, D).transpose(1, 2),
                alpha=self.scale,
            )
            probs = torch.softmax(scores, dim=-1)  # accumulates in float32 inside, also for bf16
            return torch.bmm(probs, values.reshape(B * G, kv_len, D)).view(B, lo.heads * D).to(qkv.dtype)

        split_k = self.decode_gemm == "splitk"  # where splitk.tiling_for has a tiling (B <= splitk.MAX_BATCH)
        if self.fp8 is None:
            return self._linear(self._stack(x, attend, kernels, split_k=split_k), self.w.output_weight)
        h8, hs = self._stack(x, attend, kernels, self.fp8, split_k)
        w_out, s_out = self.fp8.output
        tiling = self._one_wave(splitk.fp8_product_tiling_for(B, *w_out.shape), h8, w_out) if split_k else None
        if tiling is not None:  # the logits in the engine's dtype, scales applied, by the FP8 kernel in one K range
            return splitk.matmul_fp8(h8, hs, w_out, s_out, tiling, x.dtype)
        if fp8.rowwise_writes(x.dtype, x.device):  # both scales in the GEMM's epilogue
            return fp8.matmul_rowwise(h8, hs, w_out, s_out, x.dtype)
        return kernels.dq(fp8.matmul(h8, w_out, self.fp8.one), hs, s_out, x.dtype)

    def decode_weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (the engine's, with the FP8 copies in place of those they replace)."""
        total = self.w.nbytes()
        if self.fp8 is not None:
            total += self.fp8.nbytes() - self.fp8.replaced_nbytes(self.w)
        return total

    # -- vocabulary ----------------------------------------------------------------------------------------
    def gather_vocab(self, logits_local_BV: torch.Tensor) -> torch.Tensor:
        """The full logits [B, V_pad] on every TP rank, in the engine's dtype, megatron's padding columns included
        (the token choice drops them: sampling.select_tokens)."""
        lo = self.lo
        if lo.tp > 1:
            B = logits_local_BV.shape[0]
            gathered = logits_local_BV.new_empty((lo.tp * B, lo.vocab_local))
            dist.all_gather_into_tensor(gathered, logits_local_BV.contiguous(), group=self.group)
            logits_local_BV = gathered.view(lo.tp, B, lo.vocab_local).transpose(0, 1).reshape(B, -1)
        return logits_local_BV


def flash_varlen(q_BHD, k_packed, v_packed, cu_q, cu_k, max_k: int, used_k, scale: float) -> torch.Tensor:
    """One query per sample against its first used_k[b] keys of the packed cache (rows cu_k[b] ...): PyTorch's
    FlashAttention-2 forward in its variable-length form. Returns [B, H, D]."""
    out = torch.ops.aten._flash_attention_forward(
        q_BHD, k_packed, v_packed, cu_q, cu_k, 1, max_k, 0.0, False, False, scale=scale, seqused_k=used_k
    )[0]
    return out


def flash_decode_unavailable(dtype: torch.dtype, head_dim: int, device: torch.device) -> str | None:
    """Why `decode_attention=flash` cannot run here (None if it can): CUDA, 16-bit activations, and a tiny call that
    must match plain attention (catches a PyTorch built without FlashAttention or without `seqused_k`)."""
    if device.type != "cuda":
        return "it needs a CUDA device"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashAttention needs bfloat16 or float16 activations, the engine runs {dtype}"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        B, T, G, r, D = 2, 8, 2, 2, head_dim
        q = torch.randn(B, G * r, D, generator=g, device=device, dtype=dtype)
        k = torch.randn(B * T, G, D, generator=g, device=device, dtype=dtype)
        v = torch.randn(B * T, G, D, generator=g, device=device, dtype=dtype)
        cu = torch.arange(B + 1, device=device, dtype=torch.int32)
        used = torch.tensor([3, 8], device=device, dtype=torch.int32)
        out = flash_varlen(q, k, v, cu, cu * T, T, used, D**-0.5)
        for b in range(B):
            n = int(used[b])
            kb = k[b * T : b * T + n].float().repeat_interleave(r, dim=1)  # [n, H, D]
            vb = v[b * T : b * T + n].float().repeat_interleave(r, dim=1)
            p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), kb) * D**-0.5, dim=-1)
            ref = torch.einsum("hn,nhd->hd", p, vb)
            if not torch.allclose(out[b].float(), ref, atol=2e-2, rtol=2e-2):
                return "PyTorch's flash kernel ignored seqused_k here (its answer differs from plain attention)"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"PyTorch's flash attention kernel failed here ({type(exc).__name__}: {exc})"
    return None
