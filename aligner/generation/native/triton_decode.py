"""Decode attention in one Triton kernel: one query token per sample against its own filled cache slots.

`decode_attention(q, keys, values, pos, scale)` computes, for sample b and KV group g, softmax(q_bg k^T * scale) v
over the slots [0, pos_b] of the group-major cache (the engine's `matmul` layout: each (b, g) is one [T, D] matrix
of keys and one of values). Against the `matmul` path (a mask per step; baddbmm, softmax and bmm per layer, over every
slot up to the attention-length bucket) it
- reads each sample's filled slots only, K and V once each (an online softmax over blocks of BLOCK_N slots), so
  prompts of different lengths cost what they hold, and one CUDA graph serves every step of a call (no buckets);
- takes the r query heads of a group together as the rows of one small matrix (GQA without repeating K/V), q read
  in place from the RoPE kernel's output (strided, no copy);
- computes scores and the softmax in float32 (q rounded to the cache's dtype first, as the matmul path feeds it).
  On the GPU with a 16-bit cache both products run on 16-bit tensor cores with float32 sums: q k^T from the cache's
  own values (the products TF32 gave on them; NATIVE_QK), and p v with the probabilities rounded to the cache's
  dtype, as the matmul path's bmm and megatron's attention take them (NATIVE_PV): 1.6-2.7 % faster decode steps
  than widening both to float32 (docs/PERF.md, "Thirteenth session"). A float32 cache gets float32 products, and
  so does every cache under Triton's interpreter (the CPU tests), which multiplies 16-bit operands wrongly.
An FP8 cache (generation.kv_dtype=fp8: e4m3 keys and values, a float32 scale per slot and group) is read in float16
on tensor cores, each slot's scale applied to its score and its probability; the kernel writes the step's key and
value into it quantized (quantize_fp8's rule). The engine stores its values in chunks of V_CHUNK slots, [T / C, D, C]
(slot t, dimension d at (t // C, d, t % C)): the product p v takes V as the tensor cores' second operand, which holds
consecutive slots of one dimension in each register; from rows [T, D] the kernel gathered those bytes one at a time
from shared memory, from chunks they are contiguous and copied and read as 16-bit operands are (the kernel alone
23-33 % faster than with rows, and under the bf16 cache's time: docs/PERF.md, twenty-eighth session). The step's own
value is then written as D single bytes C apart. Its launch on the GPU (slots a step, warps, register cap, the
softmax's base) goes by the batch size: fp8_launch, timed on an H200 (docs/PERF.md, thirty-first session).
With few (sample, group) pairs and long caches the slots are cut into `splits` ranges handled by separate programs
and merged by a second small kernel (each range's max, sum and weighted values), so every SM has work.

Runs on CUDA with Triton; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, used by the tests), which
must be on before triton is first imported (its own library functions are defined then; tests/conftest.py sets it).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from aligner.generation.native import pdl
from aligner.generation.native.fp8 import E4M3, E4M3_MAX
from aligner.parallel.device import triton_kernels_unavailable

BLOCK_N = 32  # cache slots per inner step
WIDE_BLOCK_N, WIDE_MIN_BATCH = 64, 256  # ... from this many rows on (measured faster there: docs/PERF.md)
V_CHUNK = 64  # slots per chunk of an FP8 cache's values in the engine (module docstring; measured: docs/PERF.md)
# An FP8 cache's launch on the GPU, by batch size (fp8_launch): below FP8_NARROW_MIN_BATCH rows 128 slots a step in 4
# warps, from it 64 slots in 2 warps; both with a register cap of 128 (4 and 8 programs an SM, no spill in the slot
# loop) and the softmax in base 2, 2 pipeline stages. Timed in the engine on an H200 against the earlier settings (128
# slots, 4 warps, no cap, base e: 168 registers, 3 programs an SM): tokens/s +8.7 % at 64 rows, +8.8 % at 256 (each
# size's best of nine candidates; docs/PERF.md, thirty-first session). Between 64 and 256 rows not timed: 128 takes
# the narrow form, which fills an SM's 8 program slots in one wave there (1,024 programs of 8 KV groups).
FP8_NARROW_MIN_BATCH = 128
FP8_STAGES = 2
# ... and from FP8_ONE_WARP_MIN_BATCH rows (None: never), in calls without a group's shared prompt (`shared`), 32
# slots a step in one warp, capped at FP8_ONE_WARP_MAXNREG registers (0: no cap): nothing exchanged between warps in
# the slot loop. Timed on H100s uncapped (9 programs an SM), calls without groups: decode steps -0.2 to -0.7 % at 128
# rows, -1.0 to +0.4 % at 256, +1.0 % at 512; a cap of 168 (12 programs) +3 to +5 %; GRPO-shaped +0.9 to +1.5 %
# (docs/PERF.md, thirty-sixth and thirty-seventh sessions): off.
FP8_ONE_WARP_MIN_BATCH: int | None = None
FP8_ONE_WARP_MAXNREG = 0
# With an FP8 cache, the query rows a program's products hold: its r heads padded up to FP8_R_PAD (a power of two)
# instead of a tensor-core product's 16 (Triton 3.6 pads a smaller product itself; a thread of its layout then holds
# half the scores, probabilities and output): the sm_90 slot loop 787 -> 675 instructions (64 slots in 2 warps) and
# 832 -> 750 (128 in 4), half the exponentials (benchmarks/probes/attention_code.py --r-pad). Timed on an H100, FP8
# weights and cache, decode steps against 16: 8 rows -1.3 % at 64 rows, -2.7 % at 128, -3.4 % at 256; 4 rows a little
# faster again at 64 and 256 (-0.2 %, -0.5 % against 8); GRPO-shaped (8 a prompt, shared prefix) -3.9 to -5.8 % at
# 128-512 rows (docs/PERF.md, thirty-sixth session). Not for a 16-bit cache (more register copies in its loop) nor
# the group programs' form (their chunk of rows fills 16). On the CPU too: the interpreter runs the GPU's padding.
FP8_R_PAD = 4
# e4m3 -> float16 by bit operations (E4M3_BITS_ASM) instead of the GPU's conversion instruction (F2FP, one for two
# values: Hopper's conversions are said to have a low rate). In the sm_90 slot loop: 132 -> 4 conversions, 675 -> 1,087
# instructions (64 slots in 2 warps). Timed on an H100: decode steps +3.1 % at 256 rows (docs/PERF.md, thirty-sixth
# session): off.
FP8_BITS_CVT = False
# Four e4m3 bytes of $2 -> float16 values times 2^-8 in $0 (bytes 0, 1) and $1 (bytes 2, 3): each byte moved to the
# high half of a 16-bit half (prmt), its sign kept, its other 7 bits shifted one place right (e4m3's 4 exponent bits
# become float16's 5 with a leading 0: biases 7 and 15, hence 2^-8; e4m3's subnormals land on float16's exactly).
# Exact for every finite e4m3 value (tests/unit/test_triton_decode.py runs these instructions by PTX's rules).
E4M3_BITS_ASM = """{
.reg .b32 z, lo, hi, m;
mov.b32 z, 0;
prmt.b32 lo, $2, z, 0x1404;
prmt.b32 hi, $2, z, 0x3424;
and.b32 m, lo, 0x7F007F00;
shr.b32 m, m, 1;
lop3.b32 $0, lo, 0x80008000, m, 0xEA;
and.b32 m, hi, 0x7F007F00;
shr.b32 m, m, 1;
lop3.b32 $1, hi, 0x80008000, m, 0xEA;
}"""
# Each of these, set, holds for every batch size (the probes' --set: candidates compared in one tree); None: by size.
FP8_BLOCK_N: int | None = None
FP8_WARPS: int | None = None
FP8_MAXNREG: int | None = None  # 0: no cap
# The softmax in base 2 (EXP2: the scale times log2(e), exp2 for every exponential); None: with an FP8 cache on the
# GPU only (timed there), else base e. Each warp its own slots of a step (FP8_WARP_SLOTS: nothing exchanged between
# warps inside the loop, a fifth fewer loop instructions at a cap of 168, but 1.4-1.9x slower alone where timed: off).
EXP2: bool | None = None
FP8_WARP_SLOTS = False
# A group's repeated prompt (the engine prefills it once and copies its slots to every row of the group): each row's
# steps over the prompt's slots read the group's first row instead of its own copy, so the group's programs, which
# run side by side, read the same bytes (from L2 after the first). The engine passes it in calls whose rows repeat
# prompts (GRPO's groups) only. Timed on an H100, 512 rows of 8 samples a prompt, FP8 weights and cache: decode steps
# 3.609 -> 3.305 ms, tokens/s +9.0 % (docs/PERF.md, thirty-fourth session). False: every row reads its own copy.
SHARED_PREFIX = True
# ... and with it, from GROUP_PREFIX_MIN_BATCH rows, a group's prompt attended once for up to group_rows(r) of its
# rows: one group program per chunk of rows and KV group attends their query rows together over the prompt's whole
# steps (a tensor-core product has 16 rows; a row's own program fills r of them), the rows' programs their slots
# after those, the two parts merged (decode_attention's `groups`). Timed on an H100, 8 samples a prompt, FP8 weights
# and cache: decode steps -1.4 to -1.8 % at 512 rows, even at 256, +3.3 to +3.9 % at 128 (the merge and the partial
# results cost more than the shared steps save there); docs/PERF.md, thirty-fifth session. Off since the rows'
# programs hold fewer padded query rows (FP8_R_PAD; this form keeps 16): at 512 rows the shared prefix alone then
# took 3.116 ms a step against 3.271 with group programs (thirty-sixth session).
GROUP_PREFIX = False
GROUP_PREFIX_MIN_BATCH = 512
# Per-head q/k RMSNorms (Qwen3's q_layernorm / k_layernorm) applied by the decode kernel before its RoPE, where the
# engine passes RoPE to it (decode_attention's `qk_norm`): one kernel a layer fewer in such models' decode steps
# (the compiled norm-and-RoPE kernel between qkv and the attention). Timed on an H100, Qwen3-0.6B's shape with FP8
# weights and cache: decode steps -8.9 % at 64 rows, -5.4 % at 256 (docs/PERF.md, forty-fourth session); in bf16
# -5.8 / -3.2 %; Qwen3-8B's shape -3.6 / -3.7 % (FP8), -2.2 / -2.0 % (bf16) (forty-fifth session). False: that
# kernel runs.
QK_NORM = True
LOG2E = 1.4426950408889634
FUSED_WRITE_MAX_BATCH = 512  # the engine passes new_kv (and RoPE) up to this batch size (measured: docs/PERF.md)
NATIVE_QK = True  # scores from the 16-bit cache's own operands on the GPU (module docstring); False: widened, TF32
NATIVE_PV = True  # probabilities rounded to the cache's 16-bit dtype for the product with V; False: TF32
FP8 = E4M3  # the FP8 cache's element type (generation.kv_dtype: fp8)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values [..., D] -> (e4m3 values [..., D], float32 scales [...]): each head's row divided by its own
    scale amax(|row|) / 448 (1 for a row of zeros), so its largest entry lands on e4m3's largest value and x is
    about values * scale. The kernel quantizes the step's own key and value by the same rule. (fp8.quantize_rows,
    the decode weights' rule, differs: it divides by a Python scalar, which on the GPU multiplies by a reciprocal,
    and a zero row's scale is tiny, not 1; the cache's rule must match the kernel's IEEE divisions exactly.)"""
    x = x.float()
    amax = x.abs().amax(-1)
    # tensor by tensor: IEEE division on the GPU too, as the kernel's (PyTorch's CUDA division by a scalar multiplies
    # by its reciprocal)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    return (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8), scale


def write_value_chunks(dst: torch.Tensor, values: torch.Tensor) -> None:
    """Values [..., t, D] into slots [0, t) of chunked values dst [..., T / C, D, C] (the kernel's chunked layout).
    Whole chunks are written: slots [t, ceil(t / C) * C) get zeros (slots past a prompt, written by decode before
    they are read)."""
    *lead, t, D = values.shape
    C = dst.shape[-1]
    n = -(-t // C)
    as_bytes = values.view(torch.uint8) if values.dtype.itemsize == 1 else values  # e4m3: padded as bytes
    padded = torch.nn.functional.pad(as_bytes, (0, 0, 0, n * C - t)).view(values.dtype)
    dst[..., :n, :, :] = padded.view(*lead, n, C, D).transpose(-1, -2)


def value_rows(chunks: torch.Tensor) -> torch.Tensor:
    """Chunked values [..., T / C, D, C] as rows [..., T, D] (a copy)."""
    *lead, n, D, C = chunks.shape
    return chunks.transpose(-1, -2).reshape(*lead, n * C, D)


def unavailable(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128, act_dtype: torch.dtype | None = None
) -> str | None:
    """Why the Triton decode attention cannot run here (None if it can): Triton, a CUDA device of compute capability
    8.0 or newer (or Triton's interpreter), and a tiny call with the engine's cache dtype (FP8: with activations of
    `act_dtype`, default bfloat16) and head width that must match plain attention (catches a Triton that cannot build
    the kernel here before a decode step needs it)."""
    why_not = triton_kernels_unavailable(device)
    if why_not is not None:
        return why_not
    try:
        g = torch.Generator(device=device).manual_seed(0)
        B, G, r, T, D = 2, 2, 2, 4 * V_CHUNK if dtype == FP8 else 40, head_dim
        q = torch.randn(B, G, r, D, generator=g, device=device)
        kv = torch.randn(2, B, G, T, D, generator=g, device=device)
        pos = torch.tensor([5, T - 1], device=device)
        kv[:, 1, :, : T - 8] = kv[:, 0, :, : T - 8]  # rows 0 and 1: one prompt of T - 8 slots (GROUP_PREFIX's form)
        if dtype == FP8:  # values in the engine's chunks
            q = q.to(act_dtype or torch.bfloat16)
            kv8, scales = quantize_fp8(kv)
            chunks = torch.zeros(B, G, T // V_CHUNK, D, V_CHUNK, dtype=FP8, device=device)
            write_value_chunks(chunks, kv8[1])
            # each launch form the engine may take on the GPU (fp8_launch: by batch size and the call's form)
            forms = [{}]
            if q.device.type == "cuda":
                launches = [fp8_launch(n, shared) for n in (1, FP8_NARROW_MIN_BATCH, FP8_ONE_WARP_MIN_BATCH or 1)
                            for shared in (False, True)]  # fmt: skip
                forms = [f for i, f in enumerate(launches) if f not in launches[:i]]
            outs = [decode_attention(q, kv8[0], chunks, pos, D**-0.5, kv_scales=(scales[0], scales[1]), **form)
                    for form in forms]  # fmt: skip
            cache = (kv8[0], chunks, dict(kv_scales=(scales[0], scales[1])))
            kv = kv8.float() * scales[..., None]
        else:
            q, kv = q.to(dtype), kv.to(dtype)
            outs = [decode_attention(q, kv[0], kv[1], pos, D**-0.5)]
            cache = (kv[0], kv[1], {})
        scores = torch.einsum("bgrd,bgtd->bgrt", q.float(), kv[0].float()) * D**-0.5
        beyond = torch.arange(T, device=device)[None, None, None, :] > pos[:, None, None, None]
        ref = torch.einsum("bgrt,bgtd->bgrd", scores.masked_fill(beyond, float("-inf")).softmax(-1), kv[1].float())
        refs = [ref] * len(outs)
        if GROUP_PREFIX and group_rows(r) >= 2:  # both rows one chunk: the prompt's steps by a group program
            lead, length = torch.zeros(B, dtype=torch.long, device=device), torch.full((B,), T - 8, device=device)
            last = torch.full((B,), T - 1, device=device)
            groups = group_chunks(lead, length, group_rows(r))
            outs.append(decode_attention(q, cache[0], cache[1], last, D**-0.5, shared=(lead, length), groups=groups,
                                         **cache[2]))  # fmt: skip
            refs.append(torch.einsum("bgrt,bgtd->bgrd", scores.softmax(-1), kv[1].float()))
        if not all(torch.allclose(out.float(), ref, atol=2e-2, rtol=2e-2) for out, ref in zip(outs, refs, strict=True)):
            return "the kernel's answer differs from plain attention here"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"the kernel failed here ({type(exc).__name__}: {exc})"
    return None


@lru_cache(maxsize=1)
def _quantizer():
    """The FP8 cache's quantization as a jit helper, made a module global (a jit function calls another through its
    module's globals): the decode kernel's write of the step's key and value and the prefill kernel's use it."""
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_row(x, axis: tl.constexpr):
        """float32 x -> (x / scale on e4m3's grid, in float32; scale), one scale per row along `axis`, by
        quantize_fp8's rule (IEEE divisions). Rounded to the grid here (to nearest, ties to even: 3 mantissa bits,
        or steps of 2^-9 below 2^-6), so the caller's cast only relabels (Triton's interpreter rounds wrongly across
        powers of 2). The clamps take a number over a NaN (min/max), so whatever x holds the values are finite: the
        decode kernel reads whole chunks of values, slots past a position included (times probability 0)."""
        amax = tl.max(tl.abs(x), axis)
        scale = tl.where(amax > 0, tl.div_rn(amax, 448.0), 1.0)
        y = tl.minimum(tl.maximum(tl.div_rn(x, tl.expand_dims(scale, axis)), -448.0), 448.0)
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds to an integer
        sub = ((y * 512.0 + magic) - magic) / 512.0
        return tl.where(tl.abs(y) >= 0.015625, bits.to(tl.float32, bitcast=True), sub), scale

    @triton.jit
    def prefill_fp8_write(
        src_ptr, k_ptr, v_ptr, s_ptr, deq_ptr, T, G, s_c, s_b, s_t, s_g, sk_b, sk_g, sk_t, sv_b, sv_g, sv_n, ss_c,
        ss_b, ss_g, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, V_CHUNK: tl.constexpr,
    ):  # fmt: skip
        tb, bg, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # slots, (sample, group), key or value
        b, g = bg // G, bg % G
        t, dims = tb * BLOCK_T + tl.arange(0, BLOCK_T), tl.arange(0, D_PAD)
        ok = (t < T)[:, None] & (dims < D)[None, :]
        x = tl.load(src_ptr + c * s_c + b * s_b + t[:, None] * s_t + g * s_g + dims[None, :], mask=ok, other=0.0)
        y, scale = _quantize_row(x.to(tl.float32), 1)
        tl.store(s_ptr + c * ss_c + b * ss_b + g * ss_g + t, scale, mask=t < T)
        # what the prompt attends to: the values as the cache holds them, in the activations' dtype
        deq = deq_ptr + ((c * tl.num_programs(1) + bg) * T + t[:, None]) * D + dims[None, :]
        tl.store(deq, (y * scale[:, None]).to(deq_ptr.dtype.element_ty), mask=ok)
        y8 = y.to(k_ptr.dtype.element_ty)
        if c == 0:
            tl.store(k_ptr + b * sk_b + g * sk_g + t[:, None] * sk_t + dims[None, :], y8, mask=ok)
        else:
            v_at = (t[:, None] // V_CHUNK) * sv_n + dims[None, :] * V_CHUNK + t[:, None] % V_CHUNK
            tl.store(v_ptr + b * sv_b + g * sv_g + v_at, y8, mask=ok)

    global _quantize_row
    _quantize_row = quantize_row
    return prefill_fp8_write


def prefill_fp8(
    kv_2BTGD: torch.Tensor, keys_BGTD: torch.Tensor, value_chunks: torch.Tensor, scales_2BGT: torch.Tensor
) -> torch.Tensor:
    """A prompt's keys and values [2, B, T, G, D] (the activations' dtype, last dimension contiguous) quantized into
    an FP8 cache in one kernel: keys into slots [0, T) of keys [B, G, S, D], values into chunked values
    [B, G, S / C, D, C], their scales into [2, B, G, S] (quantize_fp8's rule, as the decode kernel writes a step's).
    Returns what the prompt's attention reads, [2, B, G, T, D] in the activations' dtype: the values as the cache
    holds them."""
    write = _quantizer()
    _, B, T, G, D = kv_2BTGD.shape
    if kv_2BTGD.stride(-1) != 1 or keys_BGTD.stride(-1) != 1 or scales_2BGT.stride(-1) != 1:
        raise ValueError("prefill_fp8 needs contiguous last dimensions")
    C = value_chunks.shape[-1]
    if value_chunks.stride(-2) != C or value_chunks.stride(-1) != 1:
        raise ValueError("prefill_fp8: chunked values need their last two dimensions contiguous")
    deq = torch.empty((2, B, G, T, D), dtype=kv_2BTGD.dtype, device=kv_2BTGD.device)
    block_t = 32
    write[(-(-T // block_t), B * G, 2)](
        kv_2BTGD, keys_BGTD, value_chunks, scales_2BGT, deq, T, G, kv_2BTGD.stride(0), kv_2BTGD.stride(1),
        kv_2BTGD.stride(2), kv_2BTGD.stride(3), *keys_BGTD.stride()[:3], *value_chunks.stride()[:3],
        *scales_2BGT.stride()[:3], D=D, D_PAD=max(16, 1 << (D - 1).bit_length()), BLOCK_T=block_t, V_CHUNK=C,
    )  # fmt: skip
    return deq


@lru_cache(maxsize=1)
def _kernels():
    import triton
    import triton.language as tl

    _quantizer()

    @triton.jit
    def step_rows(on_lead, leads, bases, SHARED: tl.constexpr):
        """The (keys, values, key scales, value scales) row pointers a slot step reads: `leads` where on_lead."""
        if SHARED:
            k_lead, v_lead, ks_lead, vs_lead = leads
            k_own, v_own, ks_own, vs_own = bases
            k, v = tl.where(on_lead, k_lead, k_own), tl.where(on_lead, v_lead, v_own)
            return k, v, tl.where(on_lead, ks_lead, ks_own), tl.where(on_lead, vs_lead, vs_own)
        return bases

    global _step_rows
    _step_rows = step_rows

    @triton.jit
    def head_rms(x, eps, D: tl.constexpr, axis: tl.constexpr):
        """1 / sqrt(mean(x^2) + eps) of float32 x over its D head dimensions along `axis` (padding lanes hold 0)."""
        return 1.0 / tl.sqrt(tl.sum(x * x, axis) / D + eps)

    @triton.jit
    def normed(x, inv, w):
        """x * inv times the norm weight w in float32, rounded once to w's dtype (the activations') as torch's
        rms_norm rounds its result, returned as float32 for RoPE."""
        return (x * inv * w.to(tl.float32)).to(w.dtype).to(tl.float32)

    global _head_rms, _normed
    _head_rms, _normed = head_rms, normed

    global _E4M3_BITS_ASM  # (a jit function reads a module global only as a constexpr)
    _E4M3_BITS_ASM = tl.constexpr(E4M3_BITS_ASM)

    @triton.jit
    def e4m3_bits_f16(x):
        """e4m3 values (a float8e4nv tensor) -> float16 values times 2^-8 by E4M3_BITS_ASM, four at a time."""
        return tl.inline_asm_elementwise(
            asm=_E4M3_BITS_ASM, constraints="=r,=r,r", args=[x.to(tl.uint8, bitcast=True)], dtype=tl.float16,
            is_pure=True, pack=4,
        )  # fmt: skip

    global _e4m3_bits_f16
    _e4m3_bits_f16 = e4m3_bits_f16

    @triton.jit(do_not_specialize=["n_rows"])  # (the batch size: no compilation of its own for B = 1 or 16 | B)
    def decode_attention_fwd(  # the name says "attention" to profiles (aligner.utils.profiling.kind_of)
        q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, m_ptr, l_ptr, kn_ptr, vn_ptr, cos_ptr, sin_ptr, ks_ptr, vs_ptr,
        lead_ptr, shared_ptr, row_from_ptr, chunk_ptr, qnw_ptr, knw_ptr, n_rows, sq_b, sq_g, sq_r, sk_b, sk_g, sk_t,
        sv_b, sv_g, sv_t, so_b, so_g, so_r, skn_b, skn_g,
        svn_b, svn_g, srope_b, ss_b, ss_g, scale, eps,
        R: tl.constexpr, D: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK: tl.constexpr, SPLIT_LEN: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
        WRITE_NEW: tl.constexpr, ROPE: tl.constexpr, NATIVE_QK: tl.constexpr, NATIVE_PV: tl.constexpr,
        KV_FP8: tl.constexpr, PDL: tl.constexpr, V_CHUNK: tl.constexpr, EXP2: tl.constexpr, WARP_SLOTS: tl.constexpr,
        SHARED: tl.constexpr, GROUPS: tl.constexpr, BITS_CVT: tl.constexpr, QK_NORM: tl.constexpr,
        ROTATED: tl.constexpr = 0,
    ):  # fmt: skip
        # ROTATED: with ROPE, the channels of a head RoPE rotates where fewer than D (0: all); the rest pass through
        # (the tables' sin is 0 there, so their partner does not matter: themselves)
        # EXP2: `scale` comes times log2(e) and every exponential is exp2 (scores, maxima and the split merge in base
        # 2: the same softmax, fewer products than exp's own x * log2(e))
        b, g, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        row = b  # the row whose position, lead and RoPE rows the program reads
        if GROUPS:  # programs past the n_rows rows' are group programs: chunk c's rows' prompt steps (decode_attention)
            in_chunk = b >= n_rows
            c = tl.maximum(b - n_rows, 0)
            first, count = tl.load(chunk_ptr + c * 3), tl.load(chunk_ptr + c * 3 + 1)
            chunk_len = tl.load(chunk_ptr + c * 3 + 2)
            row = tl.where(in_chunk, first, b)
            row_from = tl.load(row_from_ptr + row)
        # pos was written by an earlier step's token choice, and with PDL every kernel releases the next only after
        # its own wait: when this kernel starts, all kernels two or more before it are complete. So pos is read
        # before the wait, and the slot loop's bounds are known when the wait returns (docs/PERF.md, twenty-fourth
        # session: decode -1.8 % at 64 rows)
        pos = tl.load(pos_ptr + row)
        shared_end = 0
        if SHARED:  # the steps wholly inside slots [0, shared) read row `lead`'s cache (both set before the call)
            lead = tl.load(lead_ptr + row)
            shared_end = tl.load(shared_ptr + row) // BLOCK * BLOCK
        if PDL:  # launched early (pdl.py): wait for the qkv projection before reading its rows
            tl.extra.cuda.gdc_wait()
        # WRITE_NEW: slot pos is not read from the cache; the step's own key and value come from kn/vn, and the
        # program whose range holds pos stores them there (no other program reads that slot: no race).
        n_keys = pos if WRITE_NEW else pos + 1
        rows, dims = tl.arange(0, R_PAD), tl.arange(0, D_PAD)
        qmask = (rows < R)[:, None] & (dims < D)[None, :]
        if ROTATED == 0:
            swapped = (dims + D // 2) % D
        else:
            swapped = tl.where(dims < ROTATED, (dims + ROTATED // 2) % ROTATED, dims)
        if WRITE_NEW:  # the step's own key and value, loaded here so their latency hides under the slot loop
            writes = pos // SPLIT_LEN == s
            if GROUPS:
                writes = writes & (b < n_rows)
            dmask = (dims < D) & writes
            k_new = tl.load(kn_ptr + b * skn_b + g * skn_g + dims, mask=dmask, other=0.0)
            v_new = tl.load(vn_ptr + b * svn_b + g * svn_g + dims, mask=dmask, other=0.0)
            if ROPE:
                k_sw = tl.load(kn_ptr + b * skn_b + g * skn_g + swapped, mask=dmask, other=0.0).to(tl.float32)
        if GROUPS:  # query row i: a group program's row first + i // R, head i % R; a row program's row b, head i
            q_row = tl.where(in_chunk, first + rows // R, b)
            head = tl.where(in_chunk, rows % R, rows)
            live = tl.where(in_chunk, rows // R < count, rows < R)
            qmask = live[:, None] & (dims < D)[None, :]
            q_rows = q_ptr + q_row[:, None] * sq_b + g * sq_g + head[:, None] * sq_r
        else:
            q_rows = q_ptr + b * sq_b + g * sq_g + rows[:, None] * sq_r
        q = tl.load(q_rows + dims[None, :], mask=qmask, other=0.0)
        if ROPE:  # megatron's t * cos + rotate_half(t) * sin, with [-sin, sin] and t's halves swapped
            cos = tl.load(cos_ptr + row * srope_b + dims, mask=dims < D, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + row * srope_b + dims, mask=dims < D, other=0.0).to(tl.float32)
            q_sw = tl.load(q_rows + swapped[None, :], mask=qmask, other=0.0).to(tl.float32)
            if QK_NORM:  # each head's RMSNorm first (megatron's q_layernorm), as rope_split rounds it
                q = q.to(tl.float32)
                q_rms = _head_rms(q, eps, D, 1)
                q = _normed(q, q_rms[:, None], tl.load(qnw_ptr + dims, mask=dims < D, other=0.0))
                q_sw = _normed(q_sw, q_rms[:, None], tl.load(qnw_ptr + swapped, mask=dims < D, other=0.0))
            if GROUPS:  # each query row's own row's angles
                cos_q = tl.load(cos_ptr + q_row[:, None] * srope_b + dims[None, :], mask=qmask, other=0.0)
                sin_q = tl.load(sin_ptr + q_row[:, None] * srope_b + dims[None, :], mask=qmask, other=0.0)
                q = q.to(tl.float32) * cos_q.to(tl.float32) + q_sw * sin_q.to(tl.float32)
            else:
                q = q.to(tl.float32) * cos[None, :] + q_sw * sin[None, :]
        # The products' operand type: the cache's; for an FP8 cache float16 on tensor cores (e4m3 values are exact
        # in it and the GPU widens e4m3 to it in one instruction, not to bfloat16: measured, docs/PERF.md), else
        # the activations'. Each slot's scale multiplies its score and its probability instead of its values.
        act_t = q_ptr.dtype.element_ty
        op_t = k_ptr.dtype.element_ty
        if KV_FP8:
            op_t = act_t
            if NATIVE_QK:
                op_t = tl.float16
        q16 = q.to(op_t)
        q = q16.to(tl.float32)
        m_i = tl.full([R_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D_PAD], tl.float32)
        start = s * SPLIT_LEN
        stop = tl.minimum(start + SPLIT_LEN, n_keys)
        kv_row = b
        if GROUPS:  # (one slot range) a group program: the chunk's whole prompt steps, in the lead's cache; a row
            # program that a group program covers: from the end of those steps on
            start = tl.where(in_chunk, 0, tl.where(row_from >= 0, row_from // BLOCK * BLOCK, 0))
            stop = tl.where(in_chunk, chunk_len // BLOCK * BLOCK, stop)
            kv_row = tl.where(in_chunk, lead, b)
        k_base, v_base = k_ptr + kv_row * sk_b + g * sk_g, v_ptr + kv_row * sv_b + g * sv_g
        ks_base, vs_base = ks_ptr + kv_row * ss_b + g * ss_g, vs_ptr + kv_row * ss_b + g * ss_g
        bases = (k_base, v_base, ks_base, vs_base)
        leads = bases
        if SHARED:  # a step below shared_end reads the lead row (its slots hold the same values as this row's)
            leads = (
                k_ptr + lead * sk_b + g * sk_g, v_ptr + lead * sv_b + g * sv_g,
                ks_ptr + lead * ss_b + g * ss_g, vs_ptr + lead * ss_b + g * ss_g,
            )  # fmt: skip
        if WARP_SLOTS == 0:  # the program's warps share each step's slots (Triton splits the products among them)
            for lo in range(start, stop, BLOCK):
                k_row, v_row, ks_row, vs_row = _step_rows(lo < shared_end, leads, bases, SHARED)
                slots = lo + tl.arange(0, BLOCK)
                kvmask = (slots < stop)[:, None] & (dims < D)[None, :]
                k = tl.load(k_row + slots[:, None] * sk_t + dims[None, :], mask=kvmask, other=0.0)
                if KV_FP8:
                    k = _e4m3_bits_f16(k) if BITS_CVT else k.to(op_t)
                if NATIVE_QK:  # the cache's 16-bit operands, float32 sums: the same products as TF32 on these values
                    scores = tl.dot(q16, tl.trans(k)) * scale
                else:
                    scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION) * scale
                if KV_FP8:
                    k_s = tl.load(ks_row + slots, mask=slots < stop, other=0.0)
                    scores = scores * (k_s * 256.0 if BITS_CVT else k_s)[None, :]
                scores = tl.where((slots < stop)[None, :], scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, 1))
                alpha = tl.exp2(m_i - m_new) if EXP2 else tl.exp(m_i - m_new)
                p = tl.exp2(scores - m_new[:, None]) if EXP2 else tl.exp(scores - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                if V_CHUNK:  # values in chunks [T / V_CHUNK, D, V_CHUNK]: slot t, dim d at (t // C, d, t % C), read
                    # in whole chunks (a mask constant over each chunk lets the loads be vectors; the slots past `stop`
                    # are finite and get probability 0)
                    chunks = slots // V_CHUNK
                    v_at = chunks[:, None] * sv_t + dims[None, :] * V_CHUNK + slots[:, None] % V_CHUNK
                    v = tl.load(v_row + v_at, mask=(chunks * V_CHUNK < stop)[:, None], other=0.0)
                else:
                    v = tl.load(v_row + slots[:, None] * sv_t + dims[None, :], mask=kvmask, other=0.0)
                p_v = p  # the probabilities, with an FP8 cache times each slot's value scale
                if KV_FP8:
                    v_s = tl.load(vs_row + slots, mask=slots < stop, other=0.0)
                    p_v = p * (v_s * 256.0 if BITS_CVT else v_s)[None, :]
                    v = _e4m3_bits_f16(v) if BITS_CVT else v.to(op_t)
                if NATIVE_PV:  # probabilities rounded to the cache's dtype (as the matmul path's bmm takes them)
                    pv = tl.dot(p_v.to(v.dtype), v)
                else:
                    pv = tl.dot(p_v, v.to(tl.float32), input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
        else:  # each of the WARP_SLOTS warps its own BLOCK / WARP_SLOTS slots of a step, with its own running max,
            # sum and output: batched products over a leading warp dimension (Triton puts the warps on it), so no
            # step exchanges scores or probabilities between warps; merged once after the loop. (The loop above as
            # this form with one warp compiles to 2.5x its instructions for sm_90: hence two loops.)
            SUB: tl.constexpr = BLOCK // WARP_SLOTS
            w_rows = tl.arange(0, WARP_SLOTS)
            q3 = tl.broadcast_to(q16[None, :, :], (WARP_SLOTS, R_PAD, D_PAD))
            m3 = tl.full([WARP_SLOTS, R_PAD], float("-inf"), tl.float32)
            l3 = tl.zeros([WARP_SLOTS, R_PAD], tl.float32)
            acc3 = tl.zeros([WARP_SLOTS, R_PAD, D_PAD], tl.float32)
            dims3 = dims[None, None, :]
            for lo in range(start, stop, BLOCK):
                k_row, v_row, ks_row, vs_row = _step_rows(lo < shared_end, leads, bases, SHARED)
                slots = lo + w_rows[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [warps, SUB]
                inside = slots < stop
                k = tl.load(k_row + slots[:, :, None] * sk_t + dims3, mask=inside[:, :, None] & (dims3 < D), other=0.0)
                if NATIVE_QK:
                    scores = tl.dot(q3, tl.permute(k.to(op_t), (0, 2, 1))) * scale
                else:
                    k = tl.permute(k.to(tl.float32), (0, 2, 1))
                    scores = tl.dot(q3.to(tl.float32), k, input_precision=PRECISION) * scale
                if KV_FP8:
                    scores = scores * tl.load(ks_row + slots, mask=inside, other=0.0)[:, None, :]
                scores = tl.where(inside[:, None, :], scores, float("-inf"))
                m_new = tl.maximum(m3, tl.max(scores, 2))
                # a warp whose slots all lie past `stop` so far has max -inf: its exponentials are taken from 0
                m_from = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m3 - m_from) if EXP2 else tl.exp(m3 - m_from)
                p = tl.exp2(scores - m_from[:, :, None]) if EXP2 else tl.exp(scores - m_from[:, :, None])
                l3 = l3 * alpha + tl.sum(p, 2)
                if V_CHUNK:  # whole chunks, as above
                    chunks = slots // V_CHUNK
                    v_at = chunks[:, :, None] * sv_t + dims3 * V_CHUNK + (slots % V_CHUNK)[:, :, None]
                    v = tl.load(v_row + v_at, mask=(chunks * V_CHUNK < stop)[:, :, None], other=0.0)
                else:
                    v_mask = inside[:, :, None] & (dims3 < D)
                    v = tl.load(v_row + slots[:, :, None] * sv_t + dims3, mask=v_mask, other=0.0)
                p_v = p
                if KV_FP8:
                    p_v = p * tl.load(vs_row + slots, mask=inside, other=0.0)[:, None, :]
                    v = v.to(op_t)
                if NATIVE_PV:
                    pv = tl.dot(p_v.to(v.dtype), v)
                else:
                    pv = tl.dot(p_v, v.to(tl.float32), input_precision=PRECISION)
                acc3 = acc3 * alpha[:, :, None] + pv
                m3 = m_new
            m_i = tl.max(m3, 0)
            m_from = tl.where(m_i == float("-inf"), 0.0, m_i)
            share = tl.exp2(m3 - m_from[None, :]) if EXP2 else tl.exp(m3 - m_from[None, :])
            l_i = tl.sum(l3 * share, 0)
            acc = tl.sum(acc3 * share[:, :, None], 0)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if WRITE_NEW:
            if writes:
                if ROPE:
                    k_f = k_new.to(tl.float32)
                    k_swf = k_sw
                    if QK_NORM:  # megatron's k_layernorm before RoPE
                        k_rms = _head_rms(k_f, eps, D, 0)
                        k_f = _normed(k_f, k_rms, tl.load(knw_ptr + dims, mask=dims < D, other=0.0))
                        k_swf = _normed(k_swf, k_rms, tl.load(knw_ptr + swapped, mask=dims < D, other=0.0))
                    k_new = (k_f * cos + k_swf * sin).to(act_t if KV_FP8 else op_t)
                if KV_FP8:  # quantized by quantize_fp8's rule (IEEE divisions); attended as later steps read them
                    k8, k_s = _quantize_row(k_new.to(tl.float32), 0)
                    v8, v_s = _quantize_row(v_new.to(tl.float32), 0)
                    k8, v8 = k8.to(k_ptr.dtype.element_ty), v8.to(v_ptr.dtype.element_ty)
                    tl.store(k_base + pos * sk_t + dims, k8, mask=dmask)
                    if V_CHUNK:
                        tl.store(v_base + (pos // V_CHUNK) * sv_t + dims * V_CHUNK + pos % V_CHUNK, v8, mask=dmask)
                    else:
                        tl.store(v_base + pos * sv_t + dims, v8, mask=dmask)
                    tl.store(ks_base + pos, k_s)
                    tl.store(vs_base + pos, v_s)
                    # new names: k_new keeps its type from before the runtime branch (Triton refuses a change;
                    # its interpreter does not check, a GPU run found it)
                    k_att, v_att = k8.to(tl.float32) * k_s, v8.to(tl.float32) * v_s
                else:
                    tl.store(k_base + pos * sk_t + dims, k_new, mask=dmask)
                    tl.store(v_base + pos * sv_t + dims, v_new, mask=dmask)
                    k_att, v_att = k_new.to(tl.float32), v_new.to(tl.float32)
                score = tl.sum(q * k_att[None, :], 1) * scale
                m_new = tl.maximum(m_i, score)
                alpha = tl.exp2(m_i - m_new) if EXP2 else tl.exp(m_i - m_new)
                p_new = tl.exp2(score - m_new) if EXP2 else tl.exp(score - m_new)
                l_i = l_i * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_att[None, :]
                m_i = m_new
        if GROUPS:  # partial results [B, G, 2, R, D] (merged by decode_attention_merge): a group program's in range 0
            # of each of its rows, a row program's in range 1, and range 0 empty where no group program covers it
            part = (q_row * tl.num_programs(1) + g) * 2 + tl.where(in_chunk, 0, 1)
            at = part * R + head
            tl.store(out_ptr + at[:, None] * D + dims[None, :], acc, mask=qmask)
            tl.store(m_ptr + at, m_i, mask=live)
            tl.store(l_ptr + at, l_i, mask=live)
            alone = live & (b < n_rows) & (row_from < 0)
            empty = tl.zeros([R_PAD, D_PAD], tl.float32)
            tl.store(out_ptr + (at - R)[:, None] * D + dims[None, :], empty, mask=alone[:, None] & (dims < D)[None, :])
            tl.store(m_ptr + at - R, tl.full([R_PAD], float("-inf"), tl.float32), mask=alone)
            tl.store(l_ptr + at - R, tl.zeros([R_PAD], tl.float32), mask=alone)
        elif SPLITS == 1:
            out = acc / l_i[:, None]
            dst = out_ptr + b * so_b + g * so_g + rows[:, None] * so_r + dims[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qmask)
        else:  # this range's partial result: float32 [B, G, SPLITS, R, D] and its max and sum [B, G, SPLITS, R]
            part = (b * tl.num_programs(1) + g) * SPLITS + s
            tl.store(out_ptr + part * R * D + rows[:, None] * D + dims[None, :], acc, mask=qmask)
            tl.store(m_ptr + part * R + rows, m_i, mask=rows < R)
            tl.store(l_ptr + part * R + rows, l_i, mask=rows < R)

    @triton.jit
    def decode_attention_merge(
        acc_ptr, m_ptr, l_ptr, out_ptr, so_b, so_g, so_r,
        R: tl.constexpr, D: tl.constexpr, R_PAD: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
        EXP2: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        b, g = tl.program_id(0), tl.program_id(1)
        if PDL:  # launched early (pdl.py): wait for the attention's partial results
            tl.extra.cuda.gdc_wait()
        rows, dims = tl.arange(0, R_PAD), tl.arange(0, D_PAD)
        qmask = (rows < R)[:, None] & (dims < D)[None, :]
        first = (b * tl.num_programs(1) + g) * SPLITS
        m = tl.full([R_PAD], float("-inf"), tl.float32)
        for s in range(SPLITS):  # the overall max first: ranges past a sample's last slot hold -inf and sum 0
            m = tl.maximum(m, tl.load(m_ptr + (first + s) * R + rows, mask=rows < R, other=float("-inf")))
        total = tl.zeros([R_PAD], tl.float32)
        acc = tl.zeros([R_PAD, D_PAD], tl.float32)
        for s in range(SPLITS):
            m_s = tl.load(m_ptr + (first + s) * R + rows, mask=rows < R, other=float("-inf"))
            w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m) if EXP2 else tl.exp(m_s - m))
            total += w * tl.load(l_ptr + (first + s) * R + rows, mask=rows < R, other=0.0)
            part = tl.load(acc_ptr + (first + s) * R * D + rows[:, None] * D + dims[None, :], mask=qmask, other=0.0)
            acc += w[:, None] * part
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out = acc / total[:, None]
        dst = out_ptr + b * so_b + g * so_g + rows[:, None] * so_r + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=qmask)

    return decode_attention_fwd, decode_attention_merge, triton.next_power_of_2


def group_rows(r: int) -> int:
    """Rows of a group a group program attends (decode_attention's `groups`): the product's padded query rows over
    the r query heads of a KV group."""
    return max(16, 1 << (r - 1).bit_length()) // r


def group_chunks(lead_B: torch.Tensor, lengths_B: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention's `groups` for rows whose prompts repeat: lead_B[b] the first row of b's group (groups are
    runs of neighbouring rows), lengths_B their prompts' lengths. Each group in chunks of `rows` rows from its first;
    a chunk of one row is left to its row program. Returns (from_B, chunks [B // 2, 3] int32, unused ones zero); no
    host sync."""
    B = lead_B.numel()
    index = torch.arange(B, device=lead_B.device)
    j = index - lead_B  # the row's place in its group
    size = torch.zeros(B, dtype=torch.long, device=lead_B.device).index_add_(0, lead_B, torch.ones_like(lead_B))
    size = size[lead_B]
    count = (size - (j - j % rows)).clamp(max=rows)  # rows of the row's chunk
    covered = count >= 2
    starts = covered & (j % rows == 0)
    P = B // 2  # a chunk covers two rows or more
    at = torch.where(starts, torch.cumsum(starts, 0) - 1, P)
    chunks = torch.zeros(P + 1, 3, dtype=torch.int32, device=lead_B.device)
    chunks[at] = torch.stack((index, count, lengths_B.to(index.dtype)), 1).to(torch.int32)
    return torch.where(covered, lengths_B.to(index.dtype), -1), chunks[:P]


def choose_splits(pairs: int, max_keys: int, device: torch.device) -> int:
    """Slot ranges per (sample, group): enough programs for about two per SM, none shorter than 4 blocks."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-2 * sms // max(pairs, 1))
    return max(1, min(want, max_keys // (4 * BLOCK_N), 16))


def fp8_launch(B: int, shared: bool = False) -> dict:
    """An FP8 cache's decode attention launch on the GPU at B rows, `shared`: in a call whose rows read a group's
    prompt from its first row (the module's FP8 settings; those set hold for every size and form): decode_attention's
    block, num_warps, num_stages, maxnreg (0: no cap), exp2 and warp_slots."""
    narrow = B >= FP8_NARROW_MIN_BATCH
    one_warp = FP8_ONE_WARP_MIN_BATCH is not None and B >= FP8_ONE_WARP_MIN_BATCH and not shared
    block, warps, cap = (32, 1, FP8_ONE_WARP_MAXNREG) if one_warp else (64, 2, 128) if narrow else (128, 4, 128)
    return dict(
        block=FP8_BLOCK_N or block, num_warps=FP8_WARPS or warps, num_stages=FP8_STAGES,
        maxnreg=cap if FP8_MAXNREG is None else FP8_MAXNREG, exp2=True if EXP2 is None else EXP2,
        warp_slots=FP8_WARP_SLOTS,
    )  # fmt: skip


def decode_attention(
    q_BGrD: torch.Tensor,
    keys_BGTD: torch.Tensor,
    values_BGTD: torch.Tensor,
    pos_B: torch.Tensor,
    scale: float,
    splits: int = 1,
    block: int | None = None,
    num_warps: int | None = None,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_stages: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    exp2: bool | None = None,
    maxnreg: int | None = None,
    warp_slots: bool | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    r_pad: int | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    rotated: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sample over its slots [0, pos_B[b]]; returns [B, G, r, D] in the cache's
    dtype. Shapes are static and nothing syncs with the host: safe inside a captured CUDA graph.

    q [B, G, r, D] (any strides, last dimension contiguous); keys and values [B, G, T, D] views of the cache (last
    dimension contiguous); pos_B int [B], each < T. With `new_kv` = (k, v), each [B, G, D] (last dimension
    contiguous, the cache's dtype), the step's own key and value: the kernel writes them into slot pos_B[b] and
    attends to them there, so the decode step needs no separate cache write. With `rope` = (cos, sin_signed), each
    [B, D] (the step's rows of the engine's tables, last dimension contiguous; sin_signed = [-sin, sin]), q and the
    new key are the un-rotated rows of the qkv projection and the kernel applies megatron's RoPE to both (float32,
    rounded once to the cache's dtype, as the compiled RoPE kernel): the decode step then needs no RoPE kernel
    either. `rope` needs `new_kv` (the rotated key is only ever written by the kernel). With `qk_norm` = (q weight,
    k weight, eps), each weight [D] in q's dtype (megatron's q_layernorm / k_layernorm as RMSNorm, Qwen3's), the
    kernel normalises each query head and the new key before rotating them (with `rope` only), as the engine's
    rope_split does: the decode step then needs no kernel between the qkv projection and the attention. `rotated`:
    the channels of a head RoPE rotates where fewer than D (rotary_percent < 1), the tables passing the rest.

    An FP8 cache (keys and values float8_e4m3fn, `kv_scales` = (key scales, value scales), each [B, G, T] float32,
    last dimension contiguous, equal strides: slot t's key is about keys[b, g, t] * key_scales[b, g, t]) is read in
    the activations' dtype (q's), each slot's scale applied to its score and to its probability; `new_kv` then comes
    in q's dtype and the kernel quantizes it (quantize_fp8's rule) into the cache and the scales. The result is in
    q's dtype then. Values may come in chunks of C slots, [B, G, T / C, D, C] (the engine's FP8 layout: module
    docstring; write_value_chunks); the kernel reads whole chunks, so the slots past a sample's position in its last
    chunk must hold finite values (they get probability 0).

    `exp2` takes the softmax in base 2; `maxnreg` caps the kernel's registers a thread (a Triton launch option, 0:
    none); `warp_slots` gives each warp its own block / num_warps slots of a step (at least 16), merged once at the
    end, instead of sharing every slot among the warps; `r_pad` (a power of two) pads the r query rows of a program's
    products up to that many (16 with `groups`; not given: FP8_R_PAD with an FP8 cache, else 16). Not given, these
    and the block, warps and stages are fp8_launch(B, shared)'s with an FP8 cache on the GPU, else base e (EXP2 where
    set), no cap, shared slots.

    `shared` = (lead_B, shared_B), int [B] each: row b's steps that lie wholly inside slots [0, shared_B[b]) read
    row lead_B[b]'s keys, values (and scales) instead of its own; those slots must hold the same values in both rows
    (a repeated prompt's, copied by the engine). The step's own key and value are still written into row b.

    `groups` = (from_B, chunks_P3), with `shared`: a group's prompt attended once for several of its rows. chunks_P3
    int32 [P, 3], each (first, count, length): rows first .. first + count - 1 (2 <= count <= group_rows(r), one
    prompt of `length` slots, lead_B[first]'s cache holding it) are chunk c's; a group program per chunk and KV
    group attends their count * r query rows, one tensor-core product's rows, over the lead's whole steps inside the
    prompt, where a row program attends r rows (the product's other rows padding). from_B int [B]: the prompt's
    length for a row some chunk covers, its own steps then from the end of those whole steps; -1 for a row no chunk
    covers (it attends all its slots, reading `shared`'s lead as above). Rows [count, P) of chunks_P3 with count 0
    are unused. The two parts are merged as split ranges are: one slot range for the rows (`splits` is not used)."""
    attend, merge, pow2 = _kernels()
    B, G, r, D = q_BGrD.shape
    T = keys_BGTD.shape[2]
    for name, x in (("q", q_BGrD), ("keys", keys_BGTD), ("values", values_BGTD)):
        if x.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} needs a contiguous last dimension (strides {x.stride()})")
    chunk = 0  # values [B, G, T, D]; else in chunks of this many slots [B, G, T / chunk, D, chunk]
    if values_BGTD.dim() == 5:
        chunk = values_BGTD.shape[-1]
        if values_BGTD.shape != (B, G, T // chunk, D, chunk) or T % chunk or values_BGTD.stride(-2) != chunk:
            raise ValueError(
                f"decode_attention: chunked values need shape ({B}, {G}, {T} / chunk, {D}, chunk) with the last two "
                f"dimensions contiguous (got {tuple(values_BGTD.shape)}, strides {values_BGTD.stride()})"
            )
    kv_fp8 = keys_BGTD.dtype == FP8
    if kv_fp8 != (kv_scales is not None) or values_BGTD.dtype != keys_BGTD.dtype:
        raise ValueError("decode_attention: kv_scales go with an FP8 cache (float8_e4m3fn keys and values), only")
    act_dtype = q_BGrD.dtype if kv_fp8 else keys_BGTD.dtype
    # the launch settings not given: an FP8 cache on the GPU takes fp8_launch's (timed there), else the plain ones
    fp8_gpu = kv_fp8 and keys_BGTD.device.type == "cuda"
    if fp8_gpu:
        launch = fp8_launch(B, shared is not None)
        block = launch["block"] if block is None else block
        num_warps = num_warps or launch["num_warps"]
        num_stages = launch["num_stages"] if num_stages is None else num_stages
        maxnreg = launch["maxnreg"] if maxnreg is None else maxnreg
        warp_slots = launch["warp_slots"] if warp_slots is None else warp_slots
        exp2 = launch["exp2"] if exp2 is None else exp2
    if r_pad is None:
        r_pad = FP8_R_PAD if kv_fp8 else 16
    if r_pad < 1 or r_pad & (r_pad - 1):
        raise ValueError(f"decode_attention: r_pad must be a power of two (got {r_pad})")
    if block is None:  # the slots per inner step: BLOCK_N (WIDE_BLOCK_N from WIDE_MIN_BATCH rows)
        block = BLOCK_N if B < WIDE_MIN_BATCH else WIDE_BLOCK_N
    num_warps = num_warps or 4
    if warp_slots and (block % num_warps or block // num_warps < 16):
        raise ValueError(
            f"decode_attention: warp_slots needs the {block} slots of a step in {num_warps} warps' shares of 16 or "
            "more (fewer warps or a wider step)"
        )
    if kv_fp8:
        k_s, v_s = kv_scales
        if k_s.shape != (B, G, T) or k_s.stride() != v_s.stride() or k_s.stride(-1) != 1 or k_s.dtype != torch.float32:
            raise ValueError(f"decode_attention: kv_scales need shape ({B}, {G}, {T}), float32, equal strides")
        scale_strides = k_s.stride()[:2]
    else:
        k_s = v_s = q_BGrD  # not read
        scale_strides = (0, 0)
    if shared is None:
        lead = shared_end = pos_B  # not read
    else:
        lead, shared_end = shared
        if lead.shape != (B,) or shared_end.shape != (B,):
            raise ValueError(f"decode_attention: shared needs two tensors of shape ({B},)")
    if groups is None:
        row_from = chunks = pos_B  # not read
        n_chunks = 0
    else:
        row_from, chunks = groups
        if shared is None or row_from.shape != (B,) or chunks.dim() != 2 or chunks.shape[1] != 3:
            raise ValueError(f"decode_attention: groups need shared, from_B of shape ({B},) and chunks of shape (P, 3)")
        if chunks.dtype != torch.int32 or not chunks.is_contiguous():
            raise ValueError("decode_attention: groups' chunks need a contiguous int32 tensor")
        n_chunks, splits = chunks.shape[0], 1
    out = torch.empty((B, G, r, D), dtype=act_dtype, device=keys_BGTD.device)
    # (the group programs' chunk of rows fills a product's 16: group_rows)
    R_PAD, D_PAD = max(16 if groups is not None else r_pad, pow2(r)), max(16, pow2(D))
    split_len = -(-T // splits)
    split_len = -(-split_len // block) * block
    splits = -(-T // split_len)
    args = (*q_BGrD.stride()[:3], *keys_BGTD.stride()[:3], *values_BGTD.stride()[:3])
    if new_kv is None:
        k_new = v_new = q_BGrD  # not read
        new_strides = (0, 0, 0, 0)
    else:
        k_new, v_new = new_kv
        if k_new.stride(-1) != 1 or v_new.stride(-1) != 1 or {k_new.dtype, v_new.dtype} != {act_dtype}:
            raise ValueError(
                "decode_attention: new_kv needs the cache's dtype (q's with an FP8 cache) and a contiguous last "
                "dimension"
            )
        new_strides = (*k_new.stride()[:2], *v_new.stride()[:2])
    if rope is None:
        cos = sin = q_BGrD  # not read
        rope_stride = 0
    else:
        cos, sin = rope
        if new_kv is None:
            raise ValueError("decode_attention: rope needs new_kv (the kernel writes the rotated key)")
        if cos.shape != (B, D) or sin.shape != (B, D) or cos.stride(-1) != 1 or cos.stride() != sin.stride():
            raise ValueError(f"decode_attention: rope needs cos and sin of shape ({B}, {D}), equal strides")
        rope_stride = cos.stride(0)
    if qk_norm is None:
        q_norm_w = k_norm_w = q_BGrD  # not read
        eps = 0.0
    else:
        q_norm_w, k_norm_w, eps = qk_norm
        if rope is None:
            raise ValueError("decode_attention: qk_norm needs rope (the kernel norms the heads before rotating them)")
        for w in (q_norm_w, k_norm_w):
            if w.shape != (D,) or w.dtype != act_dtype or w.stride(0) != 1:
                raise ValueError(f"decode_attention: qk_norm's weights need shape ({D},), q's dtype, contiguous")
    native = keys_BGTD.device.type == "cuda" and act_dtype != torch.float32  # the interpreter: float32 only
    use_pdl = pdl.wanted(keys_BGTD.device, B)
    exp2 = bool(EXP2) if exp2 is None else exp2
    scale = scale * LOG2E if exp2 else scale
    common = dict(
        R=r, D=D, R_PAD=R_PAD, D_PAD=D_PAD, WRITE_NEW=new_kv is not None, ROPE=rope is not None,
        NATIVE_QK=native and NATIVE_QK, NATIVE_PV=native and NATIVE_PV, KV_FP8=kv_fp8, V_CHUNK=chunk, EXP2=exp2,
        WARP_SLOTS=num_warps if warp_slots else 0, SHARED=shared is not None, GROUPS=groups is not None,
        BITS_CVT=bool(FP8_BITS_CVT) and fp8_gpu and native and NATIVE_QK and NATIVE_PV, QK_NORM=qk_norm is not None,
    )  # fmt: skip
    if rotated is not None and rotated != D:  # (the whole head: the kernel's form as compiled before the option)
        if rope is None or not 0 < rotated < D or rotated % 2:
            raise ValueError(f"decode_attention: rotated={rotated} needs rope and an even count below D={D}")
        common["ROTATED"] = rotated
    if num_stages is not None:
        common["num_stages"] = num_stages
    if maxnreg:
        common["maxnreg"] = maxnreg
    launch = dict(PDL=use_pdl, launch_pdl=True) if use_pdl else dict(PDL=False)
    # TF32 products are exact for 16-bit keys and values; a float32 cache gets float32 products
    precision = "ieee" if act_dtype == torch.float32 else "tf32"
    if splits == 1 and groups is None:
        attend[(B, G, 1)](
            q_BGrD, keys_BGTD, values_BGTD, pos_B, out, out, out, k_new, v_new, cos, sin, k_s, v_s, lead, shared_end,
            row_from, chunks, q_norm_w, k_norm_w, B, *args,
            *out.stride()[:3], *new_strides, rope_stride, *scale_strides, scale, eps,
            BLOCK=block, SPLIT_LEN=split_len, SPLITS=1, PRECISION=precision, num_warps=num_warps, **common, **launch,
        )  # fmt: skip
        return out
    parts = 2 if groups is not None else splits  # (groups: the group programs' range and the rows' own)
    acc = torch.empty((B, G, parts, r, D), dtype=torch.float32, device=out.device)
    m = torch.empty((B, G, parts, r), dtype=torch.float32, device=out.device)
    l_ = torch.empty_like(m)
    attend[(B + n_chunks, G, splits)](
        q_BGrD, keys_BGTD, values_BGTD, pos_B, acc, m, l_, k_new, v_new, cos, sin, k_s, v_s, lead, shared_end,
        row_from, chunks, q_norm_w, k_norm_w, B, *args, 0, 0, 0,
        *new_strides, rope_stride, *scale_strides, scale, eps,
        BLOCK=block, SPLIT_LEN=split_len, SPLITS=splits, PRECISION=precision, num_warps=num_warps, **common,
        **launch,
    )  # fmt: skip
    # (with PDL after the group programs' form; after split ranges plain, as timed before it)
    merge_launch = launch if groups is not None else dict(PDL=False)
    merge[(B, G)](
        acc, m, l_, out, *out.stride()[:3], SPLITS=parts, R=r, D=D, R_PAD=R_PAD, D_PAD=D_PAD, EXP2=exp2,
        **merge_launch,
    )  # fmt: skip
    return out
