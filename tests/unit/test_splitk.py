"""The split-K decode GEMM (aligner.generation.native.splitk) under Triton's interpreter (tests/conftest.py): its
partial sums against torch's product, the tilings the engine picks, and the compiled decode kernels that add the
partials up (and meet more batch sizes than dynamo's default recompile limit)."""

import shutil

import pytest
import torch

from aligner.families import family

pytest.importorskip("triton")

from aligner.generation.native import splitk  # noqa: E402
from aligner.generation.native.fused import make_kernels  # noqa: E402


@pytest.mark.parametrize("M", [1, 5, 16, 40])
@pytest.mark.parametrize(
    "tiling",
    [splitk.Tiling(32, 32, 1), splitk.Tiling(32, 32, 4), splitk.Tiling(64, 16, 2, swap=True)],
    ids=["one-split", "four-splits", "two-splits-swapped"],
)
def test_partial_sums_add_up_to_the_product(M, tiling):
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 256, generator=g), torch.randn(128, 256, generator=g)
    out = splitk.matmul(x, w, tiling)
    if tiling.splits == 1:
        assert out.shape == (M, 128) and out.dtype == torch.float32
        total = out
    else:
        assert out.shape == (tiling.splits, M, 128) and out.dtype == torch.float32
        # each partial is the product over its own K range
        k = 256 // tiling.splits
        for s in range(tiling.splits):
            ref = x[:, s * k : (s + 1) * k] @ w[:, s * k : (s + 1) * k].t()
            torch.testing.assert_close(out[s], ref, rtol=1e-5, atol=1e-4)
        total = out.sum(0)
    torch.testing.assert_close(total, x @ w.t(), rtol=1e-5, atol=1e-4)


def test_bf16_operands_accumulate_in_float32():
    """16-bit x and W: the partials are float32 sums of exact products (as cuBLAS accumulates); one split writes the
    product rounded once to bf16 (within one bf16 step: Triton's interpreter rounds toward zero, GPUs to nearest)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    w = torch.randn(64, 512, generator=g).to(torch.bfloat16)
    exact = x.double() @ w.double().t()
    parts = splitk.matmul(x, w, splitk.Tiling(32, 64, 4))
    assert (parts.sum(0).double() - exact).abs().max() < 1e-3  # float32 sums of magnitude ~20
    one = splitk.matmul(x, w, splitk.Tiling(32, 64, 1))
    assert one.dtype == torch.bfloat16
    assert ((one.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()


def test_strided_rows_and_a_preallocated_output():
    x_wide = torch.randn(6, 300)
    x = x_wide[:, 22:278]  # rows 300 apart, last dimension contiguous
    w = torch.randn(96, 256)
    t = splitk.Tiling(32, 32, 2)
    out = torch.full((2, 6, 96), float("nan"))
    assert splitk.matmul(x, w, t, out) is out
    torch.testing.assert_close(out.sum(0), x @ w.t(), rtol=1e-5, atol=1e-4)


def test_fp8_product_in_one_split_is_written_in_the_asked_dtype():
    from aligner.generation.native import fp8

    g = torch.Generator().manual_seed(1)
    x8, xs = fp8.quantize_rows(torch.randn(5, 256, generator=g))
    w8, ws = fp8.quantize_rows(torch.randn(96, 256, generator=g))
    exact = (x8.double() * xs.double()) @ (w8.double() * ws.double()).t()
    out = splitk.matmul_fp8(x8, xs.view(-1), w8, ws.view(-1), splitk.Tiling(32, 64, 1), torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 96)
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()
    parts = splitk.matmul_fp8(x8, xs.view(-1), w8, ws.view(-1), splitk.Tiling(32, 64, 2), torch.bfloat16)
    assert parts.dtype == torch.float32 and parts.shape == (2, 5, 96)  # partial sums stay float32


def test_fp8_kernels_in_row_blocks_equal_one_block():
    """More rows than a program's block_m (the engine's tilings above 128 rows): each block of rows gets the same
    product as one program over all rows (to float32's rounding of the sums' order), the last block partly masked."""
    from aligner.generation.native import fp8

    g = torch.Generator().manual_seed(2)
    x8, xs = fp8.quantize_rows(torch.randn(40, 256, generator=g))
    w8, ws = fp8.quantize_rows(torch.randn(128, 256, generator=g))
    xs, ws = xs.view(-1), ws.view(-1)
    for splits in (1, 2):
        whole = splitk.matmul_fp8(x8, xs, w8, ws, splitk.Tiling(32, 64, splits), torch.bfloat16)
        blocks = splitk.matmul_fp8(x8, xs, w8, ws, splitk.Tiling(32, 64, splits, block_m=16), torch.bfloat16)
        assert blocks.shape == whole.shape and blocks.dtype == whole.dtype
        torch.testing.assert_close(blocks.float(), whole.float(), rtol=1e-5, atol=1e-4)
    x, w = torch.randn(40, 256, generator=g), torch.randn(128, 256, generator=g)  # the 16-bit kernel's (float32 here)
    for tiling in (splitk.Tiling(32, 64, 1, block_m=16), splitk.Tiling(32, 64, 2, block_m=16)):
        out = splitk.matmul(x, w, tiling)
        total = out if tiling.splits == 1 else out.sum(0)
        torch.testing.assert_close(total, x @ w.t(), rtol=1e-5, atol=1e-4)
    whole = splitk.gated_matmul_fp8(x8, xs, w8, ws, splitk.Tiling(32, 64, 1), torch.float32)
    blocks = splitk.gated_matmul_fp8(x8, xs, w8, ws, splitk.Tiling(32, 64, 1, block_m=16), torch.float32)
    assert blocks.shape == (40, 64)
    torch.testing.assert_close(blocks, whole, rtol=1e-5, atol=1e-5)
    exact = (x8.double() * xs[:, None].double()) @ (w8.double() * ws[:, None].double()).t()
    ref = torch.nn.functional.silu(exact[:, :64]) * exact[:, 64:]
    torch.testing.assert_close(blocks.double(), ref, rtol=1e-4, atol=1e-4)


def test_shapes_that_do_not_fit_are_refused():
    t = splitk.Tiling(64, 128, 4)
    with pytest.raises(ValueError, match="do not fit"):
        splitk.matmul(torch.randn(4, 256), torch.randn(64, 256), t)  # K=256 < 4 x 128
    with pytest.raises(ValueError, match=r"need \[M, K\] and \[N, K\]"):
        splitk.matmul(torch.randn(4, 512), torch.randn(64, 256), t)
    with pytest.raises(ValueError, match=r"need \[M, K\]"):
        splitk.matmul(torch.randn(512, 4).t(), torch.randn(64, 512), t)  # x's last dimension strided


def test_tilings_the_engine_picks():
    # the 1B model's proj [2048, 2048] and fc2 [2048, 8192]: the measured tilings (docs/PERF.md)
    for n, k in ((2048, 2048), (2048, 8192)):
        assert splitk.tiling_for(64, n, k) == splitk.Tiling(64, 128, 4, num_warps=4, num_stages=5)
        assert splitk.tiling_for(1, n, k) == splitk.tiling_for(64, n, k)
        assert splitk.tiling_for(65, n, k) == splitk.Tiling(64, 128, 4, num_warps=4, num_stages=3, swap=True)
        assert splitk.tiling_for(128, n, k).swap
        assert splitk.tiling_for(129, n, k) is None  # larger batches keep cuBLAS
    # small models: narrower blocks where they divide the sizes; none where nothing does
    assert splitk.tiling_for(4, 64, 64) == splitk.Tiling(64, 16, 4, num_warps=4, num_stages=5)
    assert splitk.tiling_for(4, 96, 256) == splitk.Tiling(32, 64, 4, num_warps=4, num_stages=5)
    assert splitk.tiling_for(4, 64, 96) is None  # 96 is not a multiple of 4 x 16
    assert splitk.tiling_for(4, 40, 256) is None


@pytest.mark.parametrize("M", [1, 5, 40])
@pytest.mark.parametrize(
    "tiling", [splitk.Tiling(32, 32, 1), splitk.Tiling(16, 64, 1, swap=True)], ids=["plain", "swapped"]
)
def test_gated_kernel_is_silu_of_the_gate_times_up(M, tiling):
    """fc1 W = [Wg; Wu] [2F, K]: the kernel's output is silu(x Wg^T) * (x Wu^T), the gate taken from the first F
    rows (megatron's [gate; up] order), not the activation of the other half."""
    g = torch.Generator().manual_seed(M)
    x, w = torch.randn(M, 256, generator=g), torch.randn(2 * 96, 256, generator=g)
    out = splitk.gated_matmul(x, w, tiling)
    assert out.shape == (M, 96) and out.dtype == x.dtype
    h = x @ w.t()
    torch.testing.assert_close(out, torch.nn.functional.silu(h[:, :96]) * h[:, 96:], rtol=1e-4, atol=1e-3)
    swapped = torch.nn.functional.silu(h[:, 96:]) * h[:, :96]
    assert (out - swapped).abs().max() > 1.0


def test_gated_kernel_rounds_bf16_once_and_refuses_what_does_not_fit():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    w = (torch.randn(128, 512, generator=g) / 8).to(torch.bfloat16)
    h = x.double() @ w.double().t()
    exact = torch.nn.functional.silu(h[:, :64]) * h[:, 64:]
    out = splitk.gated_matmul(x, w, splitk.Tiling(32, 64, 1))
    assert out.dtype == torch.bfloat16
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all()
    with pytest.raises(ValueError, match="one split"):
        splitk.gated_matmul(x, w, splitk.Tiling(32, 64, 2))
    with pytest.raises(ValueError, match="one split"):
        splitk.gated_matmul(x, w, splitk.Tiling(128, 64, 1))  # F=64 is not a multiple of 128
    with pytest.raises(ValueError, match=r"need \[M, K\], \[2F, K\]"):
        splitk.gated_matmul(x, w[:, :256], splitk.Tiling(32, 64, 1))


def test_gated_tilings_the_engine_picks():
    # the 1B model's fc1 [16384, 2048]: the measured tilings (docs/PERF.md); none past GATED_MAX_BATCH rows
    assert splitk.gated_tiling_for(64, 16384, 2048) == splitk.Tiling(64, 64, 1, num_warps=4, num_stages=5)
    assert splitk.gated_tiling_for(128, 16384, 2048) == splitk.Tiling(64, 64, 1, num_warps=8, num_stages=5)
    assert splitk.gated_tiling_for(129, 16384, 2048) is None
    assert splitk.gated_tiling_for(4, 2 * 96, 48) == splitk.Tiling(32, 16, 1, num_warps=4, num_stages=5)
    assert splitk.gated_tiling_for(4, 2 * 40, 64) is None  # F=40: no block divides it
    # FP8 fc1: blocks of 128 rows in three stages from 129 to ROW_BLOCKS_MAX_BATCH rows (measured at 256)
    assert splitk.fp8_gated_tiling_for(128, 16384, 2048) == splitk.Tiling(64, 128, 1, num_warps=8, num_stages=5)
    rows = splitk.Tiling(64, 128, 1, num_warps=8, num_stages=3, block_m=128)
    assert splitk.fp8_gated_tiling_for(256, 16384, 2048) == rows == splitk.fp8_gated_tiling_for(512, 16384, 2048)
    assert splitk.fp8_gated_tiling_for(513, 16384, 2048) is None


def test_fp8_product_tilings_the_engine_picks():
    # the 1B model's qkv [4096, 2048] and output layer [32000, 2048]: the measured tilings (docs/PERF.md)
    assert splitk.fp8_product_tiling_for(64, 4096, 2048) == splitk.Tiling(32, 256, 1, num_warps=4, num_stages=5)
    assert splitk.fp8_product_tiling_for(128, 4096, 2048) == splitk.Tiling(32, 256, 1, num_warps=4, num_stages=4)
    assert splitk.fp8_product_tiling_for(64, 32000, 2048) == splitk.Tiling(128, 128, 1, num_warps=4, num_stages=3)
    assert splitk.fp8_product_tiling_for(129, 4096, 2048) is None  # larger batches keep cuBLAS (the output layer)
    # ... but qkv (row_blocks) runs in blocks of 128 rows up to ROW_BLOCKS_MAX_BATCH (measured at 256 rows)
    rows = splitk.Tiling(64, 128, 1, num_warps=8, num_stages=5, block_m=128)
    assert splitk.fp8_product_tiling_for(256, 4096, 2048, row_blocks=True) == rows
    one_block = splitk.fp8_product_tiling_for(64, 4096, 2048)
    assert splitk.fp8_product_tiling_for(64, 4096, 2048, row_blocks=True) == one_block
    assert splitk.fp8_product_tiling_for(513, 4096, 2048, row_blocks=True) is None
    # small models: the narrowest dividing block (most programs); none where no block divides n or K
    assert splitk.fp8_product_tiling_for(4, 192, 64) == splitk.Tiling(16, 64, 1, num_warps=4, num_stages=5)
    assert splitk.fp8_product_tiling_for(4, 200, 64) is None
    assert splitk.fp8_product_tiling_for(4, 192, 40) is None


def test_available_under_the_interpreter():
    assert splitk.unavailable(torch.device("cpu"), torch.float32) is None


NO_COMPILER = not (shutil.which("g++") or shutil.which("c++"))


@pytest.mark.skipif(NO_COMPILER, reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_decode_kernels_take_every_batch_size():
    """Decode's kernels are compiled for fixed shapes, once per batch size: more batch sizes than dynamo's default
    recompile limit (8) used to stop the engine ("Hard failure due to fullgraph=True"). The partial sums' kernel adds
    them up as cuBLAS's product would be rounded, then adds and norms as add_norm does."""
    k = make_kernels(family("llama"), 1e-5, True, max_batch=12)
    eager = make_kernels(family("llama"), 1e-5, False)
    w = torch.rand(64) + 0.5
    for B in range(1, 10):  # nine sizes, through the smallest kernel
        x = torch.randn(B, 64)
        torch.testing.assert_close(k.norm(x, w, None), eager.norm(x, w, None), rtol=1e-5, atol=1e-5)
    x, parts = torch.randn(3, 64), torch.randn(4, 3, 64)
    got = k.add_parts_norm(x, parts, None, w, None)
    torch.testing.assert_close(got, eager.add_norm(x, parts.sum(0), None, w, None), rtol=1e-5, atol=1e-5)


SHAPES = {"1b": (2048, 8192, 4096, 32000), "8b": (4096, 14336, 6144, 32000)}  # hidden, ffn, qkv rows, vocabulary


def _engine_tilings(shape: str, B: int) -> dict:
    """(tiling, weight rows, operand bytes, gated) of each split-K decode GEMM the engine asks for at B rows."""
    H, F, NQ, V = SHAPES[shape]
    return {
        "proj bf16": (splitk.tiling_for(B, H, H), H, 2, False),
        "fc2 bf16": (splitk.tiling_for(B, H, F), H, 2, False),
        "fc1 bf16": (splitk.gated_tiling_for(B, 2 * F, H), 2 * F, 2, True),
        "fc1 fp8": (splitk.fp8_gated_tiling_for(B, 2 * F, H), 2 * F, 1, True),
        "fc2 fp8": (splitk.tiling_for(B, H, F), H, 1, False),
        "qkv fp8": (splitk.fp8_product_tiling_for(B, NQ, H, row_blocks=True), NQ, 1, False),
        "out fp8": (splitk.fp8_product_tiling_for(B, V, H), V, 1, False),
    }


def _stages_changed(shape: str, B: int, sms=132) -> dict:
    out = {}
    for name, (tiling, w_rows, nbytes, gated) in _engine_tilings(shape, B).items():
        fitted = splitk.one_wave(tiling, B, w_rows, nbytes, sms, gated)
        if fitted != tiling:
            assert fitted == splitk.Tiling(**{**tiling.__dict__, "num_stages": fitted.num_stages})  # stages only
            out[name] = (tiling.num_stages, fitted.num_stages)
    return out


def test_one_wave_takes_fewer_stages_only_where_the_programs_would_not_all_be_resident():
    # the 1B model's tilings were measured where they are: at every size up to 256 rows nothing changes (<= 132
    # programs, or small enough stages); at 512 rows qkv's 64 x 4 programs of 120 KiB take four stages (measured)
    for B in (1, 4, 16, 32, 64, 96, 128, 256):
        assert _stages_changed("1b", B) == {}, B
    assert _stages_changed("1b", 512) == {"qkv fp8": (5, 4)}
    # the 8B shape: qkv's 96 x 2 programs at 256 rows (measured: 22.1 -> 17.4 us), and at 64 rows the GEMMs whose
    # programs outnumber the multiprocessors at one a multiprocessor (proj / fc2 in bf16: 4 ranges x 64 = 256 programs
    # of 160 KiB; four stages' 128 KiB still hold one, three's 96 two; the decoder asks for the FP8 kernels only)
    assert _stages_changed("8b", 256) == {"qkv fp8": (5, 4)}
    assert _stages_changed("8b", 64) == {
        "proj bf16": (5, 3), "fc2 bf16": (5, 3), "fc1 bf16": (5, 4), "fc1 fp8": (5, 4), "qkv fp8": (5, 4),
    }  # fmt: skip
    assert _stages_changed("8b", 16) == {}
    # the CPU (no multiprocessor count) and the switch off: the tilings as chosen
    assert _stages_changed("8b", 64, sms=None) == {}
    tiling, w_rows, nbytes, gated = _engine_tilings("8b", 256)["qkv fp8"]
    try:
        splitk.ONE_WAVE = False
        assert splitk.one_wave(tiling, 256, w_rows, nbytes, 132, gated) == tiling
    finally:
        splitk.ONE_WAVE = True
    # a tiling whose programs fit at no fewer stages keeps its own (8B fc1 in row blocks at 256 rows: 448 programs)
    assert _stages_changed("8b", 256).get("fc1 fp8") is None
    assert splitk.one_wave(None, 64, 4096, 1, 132) is None
    # a GPU with less shared memory a multiprocessor (an L40S's 100 KiB, 142 multiprocessors): five stages' 120 KiB
    # would not launch; four's 96 KiB fit one a multiprocessor (the 8B's: no count gives one wave, the most that fit)
    for shape, B in (("8b", 64), ("1b", 64)):
        tiling, w_rows, nbytes, gated = _engine_tilings(shape, B)["qkv fp8"]
        assert tiling.num_stages == 5
        fitted = splitk.one_wave(tiling, B, w_rows, nbytes, 142, gated, sm_shared=100 * 1024)
        assert fitted.num_stages == 4
    # the bf16 kernels (waves=False): on the H100 as chosen, on that GPU only what launches (proj at 64 rows: five
    # stages of 32 KiB, 160; three's 96 fit)
    for shape, B in (("8b", 64), ("8b", 128), ("1b", 64)):
        for name in ("proj bf16", "fc2 bf16", "fc1 bf16"):
            tiling, w_rows, nbytes, gated = _engine_tilings(shape, B)[name]
            assert splitk.one_wave(tiling, B, w_rows, nbytes, 132, gated, waves=False) == tiling
    tiling, w_rows, nbytes, gated = _engine_tilings("1b", 64)["proj bf16"]
    fitted = splitk.one_wave(tiling, 64, w_rows, nbytes, 142, gated, sm_shared=100 * 1024, waves=False)
    assert (tiling.num_stages, fitted.num_stages) == (5, 3)


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from aligner.generation.native import splitk
out = []
for factory, types, constexprs, warps, stages in json.loads(sys.argv[1]):
    kernel = getattr(splitk, factory)()
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        signature[name] = "constexpr" if kernel.params[i].is_constexpr else types.get(name, "i32")
        if signature[name] != "constexpr" and name != "M":  # as the JIT sees the engine's aligned tensors
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=warps, num_stages=stages)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    out.append(compiled.metadata.shared)
print(json.dumps(out))
"""


def test_stage_bytes_are_the_compiled_kernels_shared_memory():
    """stage_bytes x num_stages is what Triton allocates for the sm_90 kernels (their loads pipelined in shared
    memory), so one_wave counts the programs a multiprocessor holds as the GPU does."""
    import json
    import os
    import subprocess
    import sys

    fp8 = {"x8_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w8_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "out_ptr": "*bf16"}
    bf16 = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32"}
    flags = dict(WIDEN=False, PDL=True)
    cases = [  # (factory, types, tiling, batch, operand bytes, gated)
        ("_fp8_kernel", fp8, splitk.Tiling(64, 128, 1, 8, 5, block_m=128), 256, 1, False),
        ("_fp8_kernel", fp8, splitk.Tiling(32, 256, 1, 4, 4), 64, 1, False),
        ("_gated_fp8_kernel", fp8, splitk.Tiling(64, 128, 1, 4, 5), 64, 1, True),
        ("_gated_kernel", {**bf16, "out_ptr": "*bf16"}, splitk.Tiling(64, 64, 1, 4, 5), 64, 2, True),
        ("_kernel", bf16, splitk.Tiling(64, 128, 4, 4, 3), 64, 2, False),
    ]
    jobs = []
    for factory, types, t, batch, _, _ in cases:
        constexprs = dict(BLOCK_M=splitk._block_m(t, batch), BLOCK_N=t.block_n, BLOCK_K=t.block_k, **flags)
        if factory in ("_kernel", "_gated_kernel"):
            constexprs.update(SWAP=False, PRECISION="tf32")
        jobs.append((factory, types, constexprs, t.num_warps, t.num_stages))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True, text=True, env=env, cwd=root,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.strip().splitlines()[-1])
    expected = [t.num_stages * splitk.stage_bytes(t, batch, nbytes, gated) for _, _, t, batch, nbytes, gated in cases]
    assert shared == expected
