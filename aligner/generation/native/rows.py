"""A decode step's row-wise pieces between two Triton GEMMs, one program per row holding the whole row in registers.

After a split-K GEMM (splitk.py) comes the residual add and RMSNorm: sum the GEMM's float32 partials, add the
residual, normalise, and with FP8 decode weights (fp8.py) quantize the normed row for the next FP8 GEMM; after the
FP8 fc1 kernel, the activation's quantization per row. torch.compile writes these as looped reductions over rows
wider than 1024 values (inductor's threshold for keeping a row in registers): one program per row that reads its
inputs again for each reduction (the norm's sum of squares, then the quantization's largest value), 3.6 us a call at
64 rows of the 1B model on the H200 (docs/PERF.md, twenty-first session). Here each program loads its row once,
and the add+norm kernel reads the residual row and the norm's weights before its PDL wait (pdl.py: they were written
two or more kernels earlier; -0.5 % a decode step at 64 rows, docs/PERF.md, twenty-fourth session).

Rounding as the compiled pieces round (fused.py): the partials summed in float32 and rounded to x's dtype, the bias
added and rounded, the residual added and rounded (megatron's x + (a + bias)), the norm in float32 times its weight,
rounded once; the quantization from the rounded row (fp8.quantize_rows). RMSNorm only: LayerNorm families keep the
compiled pieces.
Runs on CUDA with Triton; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, as the tests run it).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from aligner.generation.native import fp8, pdl


@lru_cache(maxsize=1)
def _helpers():
    """The kernels' rounding helpers, made module globals: a jit function calls another through its module's
    globals."""
    import triton
    import triton.language as tl

    @triton.jit
    def rounded(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
        """float32 v rounded to `dtype` (to nearest, ties to even) and back. EMULATE: Triton's interpreter, whose
        casts to bfloat16 truncate; the rounding then by integer arithmetic on the bits (finite values)."""
        if EMULATE:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def scale(amax, tiny, e4m3_max, RECIPROCAL: tl.constexpr):
        """fp8.quantize_rows's scale, max(amax, tiny) / 448, rounded as torch rounds it on the device: on CUDA torch
        divides by a scalar as a product with its float32 reciprocal (the H200 check: 27 of 64 scales one unit off
        an IEEE division), on the CPU it divides."""
        if RECIPROCAL:
            return tl.maximum(amax, tiny) * tl.math.div_rn(1.0, e4m3_max)
        return tl.math.div_rn(tl.maximum(amax, tiny), e4m3_max)

    global _rounded, _scale
    _rounded, _scale = rounded, scale


@lru_cache(maxsize=1)
def _add_norm_kernel():
    import triton
    import triton.language as tl

    _helpers()

    @triton.jit
    def add_norm_rows(
        x_ptr, parts_ptr, bias_ptr, w_ptr, x_out_ptr, h_ptr, hs_ptr, H, S, sp_s, sx_m, eps, tiny, e4m3_max,
        BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, QUANTIZE: tl.constexpr, EMULATE: tl.constexpr,
        RECIPROCAL: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        dtype = x_out_ptr.dtype.element_ty
        # the residual row and the weights before the wait: x was written two or more kernels before this one (the
        # norm before the GEMM before this one, or earlier), and with PDL every kernel releases the next only after
        # its own wait, so those are complete when this one starts
        x_in = tl.load(x_ptr + row * sx_m + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if PDL:  # launched early (pdl.py): wait for the kernel that wrote the partials
            tl.extra.cuda.gdc_wait()
        a = tl.zeros([BLOCK], tl.float32)
        for s in range(S):
            a += tl.load(parts_ptr + s * sp_s + row * H + cols, mask=ok, other=0.0)
        a = _rounded(a, dtype, EMULATE)
        if HAS_BIAS:
            a = _rounded(a + tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32), dtype, EMULATE)
        x = _rounded(x_in + a, dtype, EMULATE)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        tl.store(x_out_ptr + row * H + cols, x.to(dtype), mask=ok)
        h = _rounded(x * tl.rsqrt(tl.sum(x * x, axis=0) / H + eps) * w, dtype, EMULATE)
        if QUANTIZE:  # fp8.quantize_rows's rule, divisions rounded as IEEE's (Triton's "/" on float32 is an
            # approximation on the GPU), then Triton's own cast, as quantize_rows_k casts (its comment)
            scale = _scale(tl.max(tl.abs(h), axis=0), tiny, e4m3_max, RECIPROCAL)
            h8 = tl.minimum(tl.maximum(tl.math.div_rn(h, scale), -e4m3_max), e4m3_max)
            tl.store(h_ptr + row * H + cols, h8.to(h_ptr.dtype.element_ty), mask=ok)
            tl.store(hs_ptr + row, scale)
        else:
            tl.store(h_ptr + row * H + cols, h.to(dtype), mask=ok)

    return add_norm_rows


@lru_cache(maxsize=1)
def _quantize_kernel():
    import triton
    import triton.language as tl

    _helpers()

    @triton.jit
    def quantize_rows_k(
        x_ptr, q_ptr, s_ptr, N, sx_m, tiny, e4m3_max, BLOCK: tl.constexpr, RECIPROCAL: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        if PDL:
            tl.extra.cuda.gdc_wait()
        x = tl.load(x_ptr + row * sx_m + cols, mask=ok, other=0.0).to(tl.float32)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # the scale and IEEE divisions as in add_norm_rows, then Triton's own cast: on the H200 it gave torch's e4m3
        # values for all 4.7 million tried, e4m3's subnormals and far below included, where rounding to e4m3's grid
        # by hand before it (the add+norm kernel's way until the twenty-seventh session) differed on some
        # (docs/PERF.md, twenty-sixth session)
        scale = _scale(tl.max(tl.abs(x), axis=0), tiny, e4m3_max, RECIPROCAL)
        tl.store(q_ptr + row * N + cols, tl.math.div_rn(x, scale).to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row, scale)

    return quantize_rows_k


MAX_WIDTH = 16384  # widest row a program holds (values); wider rows keep the compiled pieces


NUM_WARPS = 16  # measured fastest of 4, 8, 16 for rows of 2048 and 8192 values at 64 and 128 rows (module docstring)


def _options(x: torch.Tensor, width: int, num_warps: int | None) -> dict:
    use_pdl = pdl.wanted(x.device, x.shape[0])
    options = dict(
        BLOCK=1 << (width - 1).bit_length(), RECIPROCAL=x.device.type == "cuda", PDL=use_pdl,
        num_warps=num_warps or NUM_WARPS,
    )  # fmt: skip
    if use_pdl:
        options["launch_pdl"] = True
    return options


def _fp8_out(x: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """Where a kernel writes its quantized values: e4m3 on the GPU, float32 under Triton's interpreter, whose casts to
    e4m3 change some values on e4m3's grid (128 became 64): the caller casts them."""
    return torch.empty(shape, dtype=fp8.E4M3 if x.device.type == "cuda" else torch.float32, device=x.device)


def add_parts_norm(x_MH, parts_SMH, bias_H, w_H, eps: float, quantize: bool = False, num_warps: int | None = None):
    """RMSNorm after a split-K GEMM: x' = x + (sum of the partials + bias) and h = rms_norm(x') * w; returns (x', h),
    or with `quantize` (x', h8, h scales [M, 1]) as fp8.quantize_rows gives them. x [M, H] with contiguous rows,
    partials [S, M, H] float32 contiguous."""
    M, H = x_MH.shape
    if parts_SMH.shape[1:] != (M, H) or not parts_SMH.is_contiguous() or x_MH.stride(-1) != 1 or H > MAX_WIDTH:
        raise ValueError(f"rows.add_parts_norm: x {tuple(x_MH.shape)} and partials {tuple(parts_SMH.shape)}")
    x_out = torch.empty((M, H), dtype=x_MH.dtype, device=x_MH.device)
    h = _fp8_out(x_MH, (M, H)) if quantize else torch.empty_like(x_out)
    hs = torch.empty((M, 1), dtype=torch.float32, device=x_MH.device) if quantize else x_out
    _add_norm_kernel()[(M,)](
        x_MH, parts_SMH, bias_H if bias_H is not None else w_H, w_H, x_out, h, hs, H, parts_SMH.shape[0],
        parts_SMH.stride(0), x_MH.stride(0), eps, fp8._TINY, fp8.E4M3_MAX,
        HAS_BIAS=bias_H is not None, QUANTIZE=quantize, EMULATE=_emulate(x_MH), **_options(x_MH, H, num_warps),
    )  # fmt: skip
    return (x_out, h.to(fp8.E4M3), hs) if quantize else (x_out, h)


def quantize_rows(x_MN: torch.Tensor, num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8.quantize_rows of a [M, N] matrix with contiguous rows: (x8 e4m3, scales float32 [M, 1])."""
    M, N = x_MN.shape
    if x_MN.stride(-1) != 1 or N > MAX_WIDTH:
        raise ValueError(f"rows.quantize_rows: x {tuple(x_MN.shape)} needs contiguous rows of <= {MAX_WIDTH}")
    q = _fp8_out(x_MN, (M, N))
    s = torch.empty((M, 1), dtype=torch.float32, device=x_MN.device)
    _quantize(x_MN, q, s, num_warps)
    return q.to(fp8.E4M3), s


def _quantize(x_MN, q_MN, s_M, num_warps: int | None) -> None:
    """The row quantization kernel over x's rows into q (contiguous) and s (one value a row)."""
    M, N = x_MN.shape
    _quantize_kernel()[(M,)](
        x_MN, q_MN, s_M, N, x_MN.stride(0), fp8._TINY, fp8.E4M3_MAX, **_options(x_MN, N, num_warps)
    )  # fmt: skip


def quantize_into(x_MN: torch.Tensor, q_MN: torch.Tensor, s_M: torch.Tensor) -> bool:
    """quantize_rows written into existing buffers, q e4m3 [M, N] and s float32 [M] (contiguous), where it can run
    (CUDA, contiguous rows of <= MAX_WIDTH values): one kernel reading x once (the FP8 decode weights' copies at
    refit, where fp8.quantize_rows's eager pieces pass over each weight several times). Returns whether it wrote
    them; False leaves them to the caller (off the GPU: Triton's interpreter casts to e4m3 wrongly)."""
    M, N = x_MN.shape
    if q_MN.shape != (M, N) or not q_MN.is_contiguous() or s_M.shape != (M,) or not s_M.is_contiguous():
        raise ValueError(f"rows.quantize_into: buffers {tuple(q_MN.shape)}, {tuple(s_M.shape)} for x {(M, N)}")
    if x_MN.device.type != "cuda" or x_MN.stride(-1) != 1 or N > MAX_WIDTH:
        return False
    _quantize(x_MN, q_MN, s_M, None)
    return True


def _emulate(x: torch.Tensor) -> bool:
    """Whether the kernel rounds to bfloat16 by hand: under Triton's interpreter (off CUDA), whose casts truncate."""
    return x.device.type != "cuda" and x.dtype == torch.bfloat16
