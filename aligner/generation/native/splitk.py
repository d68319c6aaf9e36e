"""A decode step's small-batch weight GEMM in one Triton kernel, cut along K: y = x @ W^T as float32 partial sums.

At decode batch sizes (M <= 128 rows) a projection reads its whole weight for very few FLOPs: the GEMM should run
at the memory's speed, but cuBLAS took 1.8-3.2x the weight's read time for the narrow ones (proj, fc2: docs/PERF.md,
twelfth session), partly because its split-K variants finish with a separate reduction kernel. Here every program
reads a [BLOCK_N, K / splits] slab of W once and multiplies it with the matching columns of all M rows of x
(tensor cores, float32 accumulation); the `splits` slabs of one output tile land as separate float32 partial sums
[splits, M, N], and the compiled elementwise kernel that follows the GEMM anyway (the residual add and norm) sums
them: no reduction kernel, no atomics. With one split the kernel writes y in x's dtype directly.

A gated MLP's fc1 (SwiGLU: W = [Wg; Wu]) has its own kernel, gated_matmul: one program reads BLOCK_N rows of both
halves over the whole K and writes silu(gate) * up, rounded once: fc1 and the activation kernel after it in one
(the activation needs whole sums, so no split).

Summing the partials in float32 and rounding once gives the same rounding point as cuBLAS (float32 accumulation,
one rounding of the product), the order of the additions aside.
Runs on CUDA with Triton; on the CPU only under Triton's interpreter (TRITON_INTERPRET=1, as the tests run it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.nn.functional as F

from aligner.generation.native import pdl
from aligner.parallel.device import triton_kernels_unavailable


@dataclass(frozen=True)
class Tiling:
    block_n: int = 64  # output columns (rows of W) per program
    block_k: int = 128  # reduction step
    splits: int = 4  # K ranges, each a program of its own
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # compute the tile as W_tile @ x^T (N on the MMA's M side) instead of x @ W_tile^T
    block_m: int | None = None  # rows of x per program (None: all of them, 16 to 128)

    def fits(self, n: int, k: int) -> bool:
        return n % self.block_n == 0 and k % (self.splits * self.block_k) == 0


@lru_cache(maxsize=1)
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_gemm(  # "gemm" in the name: profiles count it with the GEMMs (aligner.utils.profiling.kind_of)
        x_ptr, w_ptr, out_ptr, M, K_SPLIT, sx_m, sw_n, so_s, so_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
        PRECISION: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        m_blocks = tl.cdiv(M, BLOCK_M)  # a weight tile's row blocks are neighbouring programs: its second read from L2
        n0, s, m0 = (tl.program_id(0) // m_blocks) * BLOCK_N, tl.program_id(1), (tl.program_id(0) % m_blocks) * BLOCK_M
        rows, cols, ks = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
        k0 = s * K_SPLIT
        if PDL:  # launched early (pdl.py): wait for the kernel that wrote x
            tl.extra.cuda.gdc_wait()
        x_tile = x_ptr + rows[:, None] * sx_m + (k0 + ks)[None, :]
        w_tile = w_ptr + cols[:, None] * sw_n + (k0 + ks)[None, :]
        row_ok = (rows < M)[:, None]
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for _ in range(0, K_SPLIT, BLOCK_K):
            x = tl.load(x_tile, mask=row_ok, other=0.0)
            w = tl.load(w_tile)
            if WIDEN:  # Triton's interpreter multiplies 16-bit operands wrongly: widen them (exact) first
                x, w = x.to(tl.float32), w.to(tl.float32)
            if SWAP:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
            else:
                acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            x_tile += BLOCK_K
            w_tile += BLOCK_K
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        if SWAP:
            acc = tl.trans(acc)
        dst = out_ptr + s * so_s + rows[:, None] * so_m + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok)

    return splitk_gemm


@lru_cache(maxsize=1)
def _gated_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gated_gemm(  # a gated MLP's fc1 and its SwiGLU in one: silu(x @ Wg^T) * (x @ Wu^T), W = [Wg; Wu]
        x_ptr, w_ptr, out_ptr, M, K, F, sx_m, sw_n, so_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
        PRECISION: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        n0, m0 = tl.program_id(0) * BLOCK_N, tl.program_id(2) * BLOCK_M
        rows, cols, ks = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
        x_tile = x_ptr + rows[:, None] * sx_m + ks[None, :]
        g_tile = w_ptr + cols[:, None] * sw_n + ks[None, :]  # the gate's rows n0.. and the up rows F + n0..
        u_tile = g_tile + F * sw_n
        if PDL:  # as in splitk_gemm
            tl.extra.cuda.gdc_wait()
        row_ok = (rows < M)[:, None]
        if SWAP:
            acc_g = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_tile, mask=row_ok, other=0.0)
            g = tl.load(g_tile)
            u = tl.load(u_tile)
            if WIDEN:  # as in splitk_gemm: the interpreter needs float32 operands
                x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            if SWAP:
                xt = tl.trans(x)
                acc_g = tl.dot(g, xt, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(u, xt, acc_u, input_precision=PRECISION)
            else:
                acc_g = tl.dot(x, tl.trans(g), acc_g, input_precision=PRECISION)
                acc_u = tl.dot(x, tl.trans(u), acc_u, input_precision=PRECISION)
            x_tile += BLOCK_K
            g_tile += BLOCK_K
            u_tile += BLOCK_K
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        out = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(gate) * up in float32, rounded once below
        if SWAP:
            out = tl.trans(out)
        dst = out_ptr + rows[:, None] * so_m + cols[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    return gated_gemm


def gated_matmul(x_MK: torch.Tensor, w_2FK: torch.Tensor, tiling: Tiling, out: torch.Tensor | None = None):
    """silu(x @ Wg^T) * (x @ Wu^T) for a gated fc1 weight w = [Wg; Wu] [2F, K]: the SwiGLU activation [M, F] in x's
    dtype, from float32 sums rounded once. One program per BLOCK_N columns of F (and BLOCK_M rows), over the whole
    K (`tiling.splits` must be 1: the activation needs whole sums)."""
    M, K = x_MK.shape
    F = w_2FK.shape[0] // 2
    if x_MK.stride(-1) != 1 or w_2FK.stride(-1) != 1 or w_2FK.shape[1] != K or w_2FK.shape[0] != 2 * F:
        raise ValueError(f"splitk.gated_matmul: x {tuple(x_MK.shape)} and w {tuple(w_2FK.shape)} need [M, K], [2F, K]")
    if tiling.splits != 1 or not tiling.fits(F, K):
        raise ValueError(f"splitk.gated_matmul: F={F}, K={K} do not fit {tiling} (one split)")
    if out is None:
        out = torch.empty((M, F), dtype=x_MK.dtype, device=x_MK.device)
    block_m, options = _launch_options(x_MK, tiling)
    grid = (F // tiling.block_n, 1, -(-M // block_m))
    _gated_kernel()[grid](x_MK, w_2FK, out, M, K, F, x_MK.stride(0), w_2FK.stride(0), out.stride(0), **options)
    return out


def _block_m(tiling: Tiling, batch: int) -> int:
    """Rows of x per program: the tiling's, else all of them (16 to 128)."""
    return tiling.block_m or max(16, min(128, 1 << (batch - 1).bit_length()))


def _launch_options(x_MK: torch.Tensor, tiling: Tiling) -> tuple[int, dict]:
    """Rows of x per program (all of them, 16 to 128, unless the tiling says) and the launch's keyword arguments,
    the same for both kernels."""
    block_m = _block_m(tiling, x_MK.shape[0])
    use_pdl = pdl.wanted(x_MK.device, x_MK.shape[0])
    options = dict(
        BLOCK_M=block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, SWAP=tiling.swap,
        PRECISION="ieee" if x_MK.dtype == torch.float32 else "tf32", WIDEN=x_MK.device.type != "cuda",
        PDL=use_pdl,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )  # fmt: skip
    if use_pdl:
        options["launch_pdl"] = True
    return block_m, options


def matmul(x_MK: torch.Tensor, w_NK: torch.Tensor, tiling: Tiling, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T: float32 partial sums [splits, M, N] (their sum over the first dimension is the
    product), or with one split the product [M, N] in x's dtype. Both operands need a contiguous last dimension;
    N and K must fit the tiling (Tiling.fits). `out`: where to write (the shape and dtype above)."""
    M, K = x_MK.shape
    N = w_NK.shape[0]
    if x_MK.stride(-1) != 1 or w_NK.stride(-1) != 1 or w_NK.shape[1] != K:
        raise ValueError(f"splitk.matmul: x {tuple(x_MK.shape)} and w {tuple(w_NK.shape)} need [M, K] and [N, K]")
    if not tiling.fits(N, K):
        raise ValueError(f"splitk.matmul: N={N}, K={K} do not fit {tiling}")
    S = tiling.splits
    if out is None:
        shape, dtype = ((M, N), x_MK.dtype) if S == 1 else ((S, M, N), torch.float32)
        out = torch.empty(shape, dtype=dtype, device=x_MK.device)
    block_m, options = _launch_options(x_MK, tiling)
    grid = (N // tiling.block_n * -(-M // block_m), S)
    _kernel()[grid](
        x_MK, w_NK, out, M, K // S, x_MK.stride(0), w_NK.stride(0), out.stride(0) if S > 1 else 0, out.stride(-2),
        **options,
    )  # fmt: skip
    return out


@lru_cache(maxsize=1)
def _gated_fp8_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gated_fp8_gemm(  # FP8 decode weights (fp8.py): gated_gemm's work on FP8 tensor cores
        x8_ptr, xs_ptr, w8_ptr, ws_ptr, out_ptr, M, K, F, sx_m, sw_n, so_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        # the row blocks of one weight tile are neighbouring programs: they run together and the tile's second
        # read comes from L2
        m_blocks = tl.cdiv(M, BLOCK_M)
        n_block, m_block = tl.program_id(0) // m_blocks, tl.program_id(0) % m_blocks
        rows, cols, ks = (
            m_block * BLOCK_M + tl.arange(0, BLOCK_M),
            n_block * BLOCK_N + tl.arange(0, BLOCK_N),
            tl.arange(0, BLOCK_K),
        )
        if PDL:  # as in splitk_gemm
            tl.extra.cuda.gdc_wait()
        row_ok = rows < M
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(0, K, BLOCK_K):
            x = tl.load(x8_ptr + rows[:, None] * sx_m + (k + ks)[None, :], mask=row_ok[:, None], other=0.0)
            g = tl.load(w8_ptr + cols[:, None] * sw_n + (k + ks)[None, :])
            u = tl.load(w8_ptr + (F + cols)[:, None] * sw_n + (k + ks)[None, :])
            if WIDEN:  # the interpreter: float32 products of the same e4m3 values
                x, g, u = x.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
            acc_g = tl.dot(x, tl.trans(g), acc_g)
            acc_u = tl.dot(x, tl.trans(u), acc_u)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
        gate = acc_g * xs[:, None] * tl.load(ws_ptr + cols)[None, :]
        up = acc_u * xs[:, None] * tl.load(ws_ptr + F + cols)[None, :]
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + rows[:, None] * so_m + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return gated_fp8_gemm


@lru_cache(maxsize=1)
def _fp8_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def splitk_fp8_gemm(  # FP8 decode weights (fp8.py): splitk_gemm's work on FP8 tensor cores, scales at the end
        x8_ptr, xs_ptr, w8_ptr, ws_ptr, out_ptr, M, K_SPLIT, sx_m, sw_n, so_s, so_m,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WIDEN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        m_blocks = tl.cdiv(M, BLOCK_M)  # a weight tile's row blocks are neighbouring programs (gated_fp8_gemm)
        n0, s, m0 = (tl.program_id(0) // m_blocks) * BLOCK_N, tl.program_id(1), (tl.program_id(0) % m_blocks) * BLOCK_M
        rows, cols, ks = m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_K)
        k0 = s * K_SPLIT
        if PDL:  # as in splitk_gemm
            tl.extra.cuda.gdc_wait()
        row_ok = rows < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k in range(k0, k0 + K_SPLIT, BLOCK_K):
            x = tl.load(x8_ptr + rows[:, None] * sx_m + (k + ks)[None, :], mask=row_ok[:, None], other=0.0)
            w = tl.load(w8_ptr + cols[:, None] * sw_n + (k + ks)[None, :])
            if WIDEN:  # the interpreter: float32 products of the same e4m3 values
                x, w = x.to(tl.float32), w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc)
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        acc = acc * tl.load(xs_ptr + rows, mask=row_ok, other=0.0)[:, None] * tl.load(ws_ptr + cols)[None, :]
        dst = out_ptr + s * so_s + rows[:, None] * so_m + cols[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    return splitk_fp8_gemm


def matmul_fp8(x8_MK, x_scale_M, w8_NK, w_scale_N, tiling: Tiling, dtype: torch.dtype = torch.float32):
    """FP8 decode weights (fp8.py): (x8 * x_scale[row]) @ (w8 * w_scale[row of w8])^T as float32 partial sums
    [splits, M, N] (as `matmul` writes them: the norm kernel after it adds them up), both scales applied to each
    partial's float32 sums; with one split the product [M, N] in `dtype`. Rows in blocks of the tiling's block_m
    (default: all of them, up to 128)."""
    M, K = x8_MK.shape
    N = w8_NK.shape[0]
    if w8_NK.shape[1] != K or x_scale_M.numel() != M or w_scale_N.numel() != N:
        raise ValueError(
            f"splitk.matmul_fp8: x8 {tuple(x8_MK.shape)}, w8 {tuple(w8_NK.shape)} and the scales do not match"
        )
    if not (x_scale_M.is_contiguous() and w_scale_N.is_contiguous()):
        raise ValueError("splitk.matmul_fp8: the scales must be contiguous")
    if not tiling.fits(N, K):
        raise ValueError(f"splitk.matmul_fp8: N={N}, K={K} do not fit {tiling}")
    S = tiling.splits
    out = torch.empty((S, M, N), dtype=torch.float32 if S > 1 else dtype, device=x8_MK.device)
    block_m, options = _fp8_options(x8_MK, tiling)
    _fp8_kernel()[(N // tiling.block_n * -(-M // block_m), S)](
        x8_MK, x_scale_M, w8_NK, w_scale_N, out, M, K // S, x8_MK.stride(0), w8_NK.stride(0), out.stride(0),
        out.stride(1), **options,
    )  # fmt: skip
    return out if S > 1 else out[0]


def _fp8_options(x8_MK: torch.Tensor, tiling: Tiling) -> tuple[int, dict]:
    """_launch_options for the FP8 kernels (no swapped form; their products are FP8)."""
    block_m, options = _launch_options(x8_MK, tiling)
    del options["SWAP"], options["PRECISION"]
    return block_m, options


def gated_matmul_fp8(x8_MK, x_scale_M, w8_2FK, w_scale_2F, tiling: Tiling, dtype: torch.dtype) -> torch.Tensor:
    """FP8 decode weights (fp8.py): silu(g) * u in `dtype` [M, F], g = (x8 @ Wg8^T) * x_scale[row] * w_scale[col]
    and u likewise from the rows F.. of w8 = [Wg8; Wu8] [2F, K], from float32 sums rounded once (gated_matmul on FP8
    tensor cores: fc1, its scales and the SwiGLU in one kernel, where cuBLAS's FP8 GEMM and the activation kernel
    were two). One program per `tiling.block_n` columns over the whole K; up to 128 rows."""
    M, K = x8_MK.shape
    F = w8_2FK.shape[0] // 2
    if w8_2FK.shape != (2 * F, K) or x_scale_M.numel() != M or w_scale_2F.numel() != 2 * F:
        raise ValueError(
            f"splitk.gated_matmul_fp8: x8 {tuple(x8_MK.shape)}, w8 {tuple(w8_2FK.shape)} and the scales do not match"
        )
    if not (x_scale_M.is_contiguous() and w_scale_2F.is_contiguous()):
        raise ValueError("splitk.gated_matmul_fp8: the scales must be contiguous")
    if tiling.splits != 1 or not tiling.fits(F, K):
        raise ValueError(f"splitk.gated_matmul_fp8: F={F}, K={K} do not fit {tiling} (one split)")
    out = torch.empty((M, F), dtype=dtype, device=x8_MK.device)
    block_m, options = _fp8_options(x8_MK, tiling)
    _gated_fp8_kernel()[(F // tiling.block_n * -(-M // block_m),)](
        x8_MK, x_scale_M, w8_2FK, w_scale_2F, out, M, K, F, x8_MK.stride(0), w8_2FK.stride(0), out.stride(0),
        **options,
    )  # fmt: skip
    return out


MAX_BATCH = 128  # decode steps of more rows keep cuBLAS (measured only up to here: docs/PERF.md)


def tiling_for(batch: int, n: int, k: int) -> Tiling | None:
    """The tiling a decode step of `batch` rows uses for W [n, k] (None: keep cuBLAS). Measured on the H200 at the
    1B model's row-parallel projections (scripts/bench_decode_kernels.py --splitk; docs/PERF.md): four K ranges of
    128-wide steps over 64 output columns, five pipeline stages at <= 64 rows, three (and the swapped product) up to
    128. Smaller models (tests) get narrower blocks where these do not divide their sizes."""
    if batch > MAX_BATCH:
        return None
    block_n = next((b for b in (64, 32, 16) if n % b == 0), None)
    splits, block_k = 4, 128
    while block_k > 16 and k % (splits * block_k):
        block_k //= 2
    if block_n is None or k % (splits * block_k):
        return None
    if batch <= 64:
        return Tiling(block_n, block_k, splits, num_warps=4, num_stages=5)
    return Tiling(block_n, block_k, splits, num_warps=4, num_stages=3, swap=True)


GATED_MAX_BATCH = 128  # decode steps of more rows run fc1 by cuBLAS and the activation by its compiled kernel


def gated_tiling_for(batch: int, two_f: int, k: int) -> Tiling | None:
    """The tiling of gated_matmul for a decode step of `batch` rows and a gated fc1 weight [two_f, k] (None: keep
    cuBLAS and the activation kernel). Measured on the H200 at the 1B model's fc1 [16384, 2048]
    (scripts/bench_decode_kernels.py --gated; docs/PERF.md): 64 columns of each half per program, 64-wide K steps,
    five pipeline stages; eight warps above 64 rows."""
    return _gated_tiling(batch, two_f, k, block_ks=(64, 32, 16))


def _gated_tiling(batch: int, two_f: int, k: int, block_ks: tuple[int, ...]) -> Tiling | None:
    """One program per 64 (or 32, 16) columns of each half over the whole K, the widest of `block_ks` dividing K."""
    f = two_f // 2
    if batch > GATED_MAX_BATCH or two_f % 2:
        return None
    block_n = next((b for b in (64, 32, 16) if f % b == 0), None)
    block_k = next((b for b in block_ks if k % b == 0), None)
    if block_n is None or block_k is None:
        return None
    return Tiling(block_n, block_k, 1, num_warps=4 if batch <= 64 else 8, num_stages=5)


# FP8 fc1 and qkv: decode steps of GATED_MAX_BATCH (MAX_BATCH) to ROW_BLOCKS_MAX_BATCH rows run by the Triton kernels
# in blocks of ROW_BLOCK rows (a weight tile's blocks neighbouring programs, so its second read comes from L2), where
# cuBLAS's FP8 GEMMs with the kernels around them were slower (docs/PERF.md, twenty-sixth session, 256 rows: fc1 and
# its activation 16.9 + 8.5 -> 17.9 + 3.0 us a layer, qkv 9.4 -> 7.5); fc2, proj and the output layer keep cuBLAS.
ROW_BLOCK = 128
ROW_BLOCKS_MAX_BATCH = 512


def fp8_gated_tiling_for(batch: int, two_f: int, k: int) -> Tiling | None:
    """The tiling of gated_matmul_fp8 for a decode step of `batch` rows and an e4m3 fc1 [two_f, k] (None: keep cuBLAS
    and the activation kernel). Measured on the H200 at the 1B model's fc1 at 64 rows (benchmarks/probes/fp8_mlp.py,
    docs/PERF.md): 64 columns of each half per program, 128-wide K steps (half the bytes of bf16's 64), five stages,
    four warps (eight above 64 rows); above GATED_MAX_BATCH rows, blocks of ROW_BLOCK rows in three stages."""
    if GATED_MAX_BATCH < batch <= ROW_BLOCKS_MAX_BATCH:  # the blocks of columns and K steps of GATED_MAX_BATCH rows
        tiling = _gated_tiling(GATED_MAX_BATCH, two_f, k, block_ks=(128, 64, 32))
        return None if tiling is None else replace(tiling, num_warps=8, num_stages=3, block_m=ROW_BLOCK)
    return _gated_tiling(batch, two_f, k, block_ks=(128, 64, 32))


def fp8_product_tiling_for(batch: int, n: int, k: int, row_blocks: bool = False) -> Tiling | None:
    """The tiling of matmul_fp8 in one K range (the product written in the engine's dtype: qkv and the output layer
    with FP8 decode weights) for a decode step of `batch` rows and an e4m3 W [n, k] (None: keep cuBLAS). Measured on
    the H200 at the 1B model's qkv [4096, 2048] and output layer [32000, 2048], 64 and 128 rows
    (benchmarks/probes/fp8_attention_gemms.py, docs/PERF.md): the widest of 128, 64, 32 columns per program that
    still makes >= 128 programs, 256-wide K steps in 5 stages for 32 columns (4 above 64 rows), 128-wide in 3 stages
    for wider blocks. Smaller models (tests): the narrowest block dividing n, as many programs as it can.
    With `row_blocks` (qkv), steps of MAX_BATCH to ROW_BLOCKS_MAX_BATCH rows too: 64 columns and ROW_BLOCK rows per
    program, 128-wide K steps in five stages (four where they would not all be resident at once: one_wave), eight
    warps (measured at 256 rows; the output layer keeps cuBLAS)."""
    if row_blocks and MAX_BATCH < batch <= ROW_BLOCKS_MAX_BATCH:
        block_n = next((b for b in (64, 32, 16) if n % b == 0), None)
        block_k = next((b for b in (128, 64, 32, 16) if k % b == 0), None)
        if block_n is None or block_k is None:
            return None
        return Tiling(block_n, block_k, 1, num_warps=8, num_stages=5, block_m=ROW_BLOCK)
    if batch > MAX_BATCH:
        return None
    dividing = [b for b in (128, 64, 32, 16) if n % b == 0]
    if not dividing:
        return None
    block_n = next((b for b in dividing if n // b >= 128), dividing[-1])
    block_k = 256 if block_n <= 32 else 128
    while block_k > 16 and k % block_k:
        block_k //= 2
    if k % block_k:
        return None
    stages = 3 if block_n >= 64 else (5 if batch <= 64 else 4)
    return Tiling(block_n, block_k, 1, num_warps=4, num_stages=stages)


def stage_bytes(tiling: Tiling, batch: int, operand_bytes: int, gated: bool = False) -> int:
    """Shared memory one pipeline stage of the split-K kernels holds for a step of `batch` rows: a block of x and the
    program's weight rows (both halves' with `gated`) over one K step; a compiled kernel holds num_stages of them
    (tests/unit/test_splitk.py compiles them for sm_90 and compares)."""
    block_m = _block_m(tiling, batch)
    return (block_m + tiling.block_n * (2 if gated else 1)) * tiling.block_k * operand_bytes


# Shared memory an sm_90 multiprocessor (H100, H200) gives its programs (where PyTorch does not say the GPU's own),
# and what CUDA reserves of it for each program
SM_SHARED, SHARED_RESERVED = 233_472, 1024
ONE_WAVE = True  # off: the tilings as chosen (the engine probes' --set splitk.ONE_WAVE=False times both in one tree)


def one_wave(
    tiling: Tiling | None,
    batch: int,
    w_rows: int,
    operand_bytes: int,
    sms: int | None,
    gated: bool = False,
    sm_shared: int = SM_SHARED,
    waves: bool = True,
) -> Tiling | None:
    """`tiling` for a decode step of `batch` rows and a weight of `w_rows` rows ([2F, K] with `gated`: the gated
    kernels' programs take `block_n` rows of each half), with fewer pipeline stages (down to 3) where that lets all
    its programs be resident on the GPU's `sms` multiprocessors (`sm_shared` bytes of shared memory each) at once;
    unchanged where they already are, where no fewer stages make them, and on the CPU (`sms` None). Where one program
    of its stages would not fit a multiprocessor at all (a GPU with less shared memory than the H100 it was measured
    on: Ada's and the A10's 100 KiB against 120-160 KiB), the most stages that do; with `waves` False only that.

    Each stage holds a block of x and the program's weight rows over one K step in shared memory (`operand_bytes`
    an element): the tilings measured on the 1B model (<= 128 programs) hold 96-160 KiB, one or two programs a
    multiprocessor, so a weight with more columns (the 8B shape's qkv: 192 programs of 120 KiB) or more row blocks
    ran its last programs in a second wave. Measured (fp8_row_blocks.py, docs/PERF.md, forty-third session, an H100):
    the FP8 qkv in row blocks at 256 rows of the 8B shape 22.08 us a layer in five stages, 17.40 in four; the 1B's at
    512 rows 13.72 and 10.47 (at 256 rows, 128 programs, five stages stay: 8.14 against 9.09). In the engine (8B
    shape, FP8 weights and cache) decode steps of 64 / 128 / 512 rows 4.0 / 1.1 / 1.3 % faster; the bf16 kernels'
    fewer stages at 64 and 128 rows gave nothing (+0.0 / +0.3 %), so the decoder asks for the FP8 kernels only."""
    if tiling is None or sms is None or not ONE_WAVE:
        return tiling
    block_m = _block_m(tiling, batch)
    rows_a_program = tiling.block_n * (2 if gated else 1)
    programs = w_rows // rows_a_program * -(-batch // block_m) * tiling.splits
    per_stage = stage_bytes(tiling, batch, operand_bytes, gated)

    def resident(stages: int) -> int:
        return sms * (sm_shared // (stages * per_stage + SHARED_RESERVED))

    if programs <= resident(tiling.num_stages) or (not waves and resident(tiling.num_stages) > 0):
        return tiling
    fewer = range(tiling.num_stages - 1, 1, -1)
    stages = next((s for s in fewer if waves and s >= 3 and programs <= resident(s)), None)
    if stages is None and resident(tiling.num_stages) == 0:  # it would not launch: the most stages that fit
        stages = next((s for s in fewer if resident(s) > 0), None)
    return tiling if stages is None else replace(tiling, num_stages=stages)


def unavailable(device: torch.device, dtype: torch.dtype, fp8_weights: bool = False) -> str | None:
    """Why the split-K kernel cannot run here (None if it can): Triton, a CUDA device of compute capability 8.0 or
    newer (bf16 tensor cores; or Triton's interpreter), and a tiny call that must match torch's product; with
    `fp8_weights` (FP8 decode weights, fp8.py) also gated_matmul_fp8 and matmul_fp8, against float32 maths of the
    same values, and the row kernels (rows.py: the quantization, the add+norm's quantized row) against
    fp8.quantize_rows."""
    why_not = triton_kernels_unavailable(device)
    if why_not is not None:
        return why_not
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(5, 256, generator=g, device=device).to(dtype)
        w = torch.randn(64, 256, generator=g, device=device).to(dtype)
        got = matmul(x, w, Tiling(block_n=32, block_k=32, splits=4)).sum(0)
        if not torch.allclose(got, x.float() @ w.float().t(), atol=1e-2, rtol=1e-3):
            return "the kernel's answer differs from torch's product here"
        if fp8_weights:
            from aligner.generation.native import fp8, rows

            x32 = torch.randn(5, 64, generator=g, device=device)
            x8, xs = fp8.quantize_rows(x32)
            w8, ws = fp8.quantize_rows(torch.randn(64, 64, generator=g, device=device))
            got = gated_matmul_fp8(x8, xs, w8, ws, Tiling(block_n=32, block_k=32, splits=1), torch.float32)
            gate, up = ((x8.float() * xs) @ (w8.float() * ws).t()).chunk(2, dim=-1)
            if not torch.allclose(got, F.silu(gate) * up, atol=1e-3, rtol=1e-3):
                return "the FP8 fc1 kernel's answer differs from float32 maths here"
            ref = (x8.float() * xs) @ (w8.float() * ws).t()
            y = matmul_fp8(x8, xs, w8, ws, Tiling(block_n=32, block_k=32, splits=2)).sum(0)
            if not torch.allclose(y, ref, atol=1e-3, rtol=1e-3):
                return "the FP8 split-K kernel's answer differs from float32 maths here"
            y = matmul_fp8(x8, xs, w8, ws, Tiling(block_n=32, block_k=32, splits=1), torch.float32)
            if not torch.allclose(y, ref, atol=1e-3, rtol=1e-3):
                return "the FP8 kernel's one-range product differs from float32 maths here"
            # values over e4m3's whole range, its subnormals included (2^-14 of a row's largest and below)
            spread = torch.exp2(torch.randint(-14, 1, x32.shape, generator=g, device=device).float())
            for x in (x32, x32 * spread):
                m8, ms = rows.quantize_rows(x)
                r8, rs = fp8.quantize_rows(x)
                if not (torch.equal(ms, rs) and torch.equal(m8.float(), r8.float())):
                    return "the row quantization kernel's answer differs from torch's here"
                # the add+norm kernel's quantized row against torch's quantization of its own normed row
                x16, parts = x.to(dtype), torch.randn(2, *x.shape, generator=g, device=device)
                norm_w = spread[0].to(dtype)
                _, h = rows.add_parts_norm(x16, parts, None, norm_w, 1e-5)
                _, h8, hs = rows.add_parts_norm(x16, parts, None, norm_w, 1e-5, quantize=True)
                r8, rs = fp8.quantize_rows(h)
                if not (torch.equal(hs, rs) and torch.equal(h8.float(), r8.float())):
                    return "the add+norm kernel's quantization differs from torch's here"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"the kernel failed here ({type(exc).__name__}: {exc})"
    return None
