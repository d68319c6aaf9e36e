"""Decode-step kernels of the 1B benchmark model, one at a time, on a GPU (scripts/bench_decode_kernels.py).

- attention: per layer, the `matmul` path's kernels (additive mask, baddbmm, softmax, bmm over the slots up to the
  attention-length bucket) against the Triton kernel (aligner.generation.native.triton_decode) for several slot
  blocks, warp counts and slot ranges (splits); each against float32 attention (max |error|) and the floor (K and V
  of the filled slots read once at the copy bandwidth, 4.2 TB/s on the H200);
- weight GEMMs: each of a layer's four projections and the output layer at decode batch sizes, x @ W^T as the
  engine computes it and other layouts (F.linear, a pre-transposed W, W @ x^T), against max(weight read, FLOPs at
  790 TFLOP/s); and their sum over one decode step (16 layers and the output layer).
Each number is the mean over replays of a CUDA graph of 10-16 calls, in microseconds per call.
With `prefill=True` (`--prefill`): prefill's compiled RoPE + split and RMSNorm with batch and prompt width dynamic
(what the engine runs, aligner.generation.native.fused) against the same functions compiled with every size
symbolic (`dynamic=True`, before afcbc3f), plain calls timed with CUDA events. With `autotune=True`
(`--gemm-autotune`, minutes of compiling): each weight GEMM at B=64 and 256 under
`torch.compile(mode="max-autotune-no-cudagraphs")` (Triton templates and cuBLAS) against cuBLAS's x @ W^T. With
`fp8=True` (`--fp8`): the weight GEMMs in bf16 and in FP8 (generation.decode_weights: fp8) over distinct weights.
With `splitk=True` (`--splitk`): each bf16 weight GEMM at B=64 and 128 as cuBLAS runs it against the split-K Triton
kernel (aligner.generation.native.splitk) over a grid of tilings, alone and with its partial sums added up by a
compiled kernel (as the engine's residual add does it), over distinct weights. With `attention_products=True`
(`--attention-products`): the Triton attention with its products on 16-bit tensor cores (the engine's, NATIVE_QK and
NATIVE_PV) against widened TF32 operands and the mix, over 16 layers' caches in turn. With `gated` (`--gated`): fc1
and its SwiGLU, cuBLAS + the compiled activation against one Triton kernel (splitk.gated_matmul) over its tilings.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from aligner.generation.native.triton_decode import choose_splits, decode_attention

GROUPS, GROUP_SIZE, HEAD_DIM = 8, 2, 128  # the 1B model: 16 query heads in 8 KV groups of width 128
HIDDEN, FFN, VOCAB, LAYERS = 2048, 8192, 32000, 16
BANDWIDTH, PEAK_FLOPS = 4.2e12, 790e12  # measured on the H200 (docs/PERF.md)
ATTENTION_CASES = ((64, 256), (256, 256), (512, 256), (512, 384), (8, 384), (64, 2048))  # (batch, filled slots)


def graph_time_us(fn, calls: int = 16, replays: int = 20) -> float:
    """Mean microseconds per call of `fn`, `calls` of them captured in one CUDA graph, over `replays` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2 * calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / calls * 1e3


def _matmul_attention(q, keys, values, pos, kv_len: int, scale: float):
    """The engine's `matmul` decode attention for one layer, its per-step mask included."""
    B, G, r, D = q.shape
    beyond = torch.arange(kv_len, device=q.device)[None] > pos[:, None]
    mask = torch.zeros(B, 1, 1, kv_len, dtype=keys.dtype, device=q.device)
    mask = mask.masked_fill_(beyond.view(B, 1, 1, kv_len), float("-inf")).expand(B, G, 1, kv_len)
    scores = torch.baddbmm(
        mask.reshape(B * G, 1, kv_len),
        q.reshape(B * G, r, D),
        keys[:, :, :kv_len].reshape(B * G, kv_len, D).transpose(1, 2),
        alpha=scale,
    )
    return torch.bmm(torch.softmax(scores, -1), values[:, :, :kv_len].reshape(B * G, kv_len, D)).view(B, G, r, D)


def attention_rows(device) -> list[dict]:
    rows, scale = [], HEAD_DIM**-0.5
    for B, filled in ATTENTION_CASES:
        T = max(384, filled)
        kv = torch.randn(2, B, GROUPS, T, HEAD_DIM, device=device, dtype=torch.bfloat16)
        q = torch.randn(B, GROUPS, GROUP_SIZE + 2, HEAD_DIM, device=device, dtype=torch.bfloat16)[:, :, :GROUP_SIZE]
        pos = torch.full((B,), filled - 1, device=device)
        probs = torch.einsum("bgrd,bgtd->bgrt", q.float(), kv[0, :, :, :filled].float()) * scale
        exact = torch.einsum("bgrt,bgtd->bgrd", probs.softmax(-1), kv[1, :, :, :filled].float())
        kv_len = -(-filled // 64) * 64  # the engine's default bucket (generation.kv_block: 64)

        def matmul(q=q, kv=kv, pos=pos, kv_len=kv_len):
            return _matmul_attention(q, kv[0], kv[1], pos, kv_len, scale)

        row = {
            "batch": B,
            "filled_slots": filled,
            "floor_us": 2 * B * GROUPS * filled * HEAD_DIM * 2 / BANDWIDTH * 1e6,
            "matmul_us": graph_time_us(matmul),
            "matmul_err": float((matmul().float() - exact).abs().max()),
        }
        auto = choose_splits(B * GROUPS, T, device)
        for block, warps, splits in itertools.product((32, 64, 128), (4, 8), sorted({1, auto})):

            def triton(q=q, kv=kv, pos=pos, splits=splits, block=block, warps=warps):
                return decode_attention(q, kv[0], kv[1], pos, scale, splits, block, warps)

            name = f"triton_b{block}_w{warps}_s{splits}"
            row[f"{name}_us"] = graph_time_us(triton)
            row[f"{name}_err"] = float((triton().float() - exact).abs().max())
        rows.append(row)
    return rows


GEMM_SHAPES = {  # the decode step's weight GEMMs: name -> (N, K) of W
    "qkv": (HIDDEN + 2 * GROUPS * HEAD_DIM, HIDDEN),
    "proj": (HIDDEN, HIDDEN),
    "fc1": (2 * FFN, HIDDEN),
    "fc2": (HIDDEN, FFN),
    "output": (VOCAB, HIDDEN),
}


def gemm_rows(device, batches=(64, 256, 512)) -> list[dict]:
    rows = []
    for M in batches:
        for name, (n, k) in GEMM_SHAPES.items():
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            w_t = w.t().contiguous()
            x = torch.randn(M, k, device=device, dtype=torch.bfloat16)
            variants = {
                "x@W^T": lambda x=x, w=w: torch.matmul(x, w.t()),
                "F.linear": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                "x@(W^T contiguous)": lambda x=x, w_t=w_t: torch.matmul(x, w_t),
                "W@x^T": lambda x=x, w=w: torch.matmul(w, x.t()),
            }
            row = {"batch": M, "gemm": name, "floor_us": max(2 * n * k / BANDWIDTH, 2 * M * n * k / PEAK_FLOPS) * 1e6}
            row.update({f"{v}_us": graph_time_us(fn, calls=10, replays=50) for v, fn in variants.items()})
            rows.append(row)
    return rows


def per_step_ms(rows: list[dict], batch: int) -> dict:
    """Sum over one decode step: every layer's four projections and the output layer once."""
    mine = [r for r in rows if r["batch"] == batch]
    keys = [k for k in mine[0] if k.endswith("_us")]
    return {k[:-3]: sum(r[k] * (1 if r["gemm"] == "output" else LAYERS) for r in mine) / 1e3 for k in keys}


def events_time_us(fn, calls: int = 20) -> float:
    """Mean microseconds per call of `fn` over `calls` plain calls after three warm-up calls (CUDA events)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def prefill_rows(device) -> list[dict]:
    from aligner.families import family
    from aligner.generation.native import fused

    eager = fused.make_kernels(family("llama"), 1e-5, False, prefill=True)
    engine = fused.make_kernels(family("llama"), 1e-5, True, prefill=True)
    symbolic = {n: torch.compile(getattr(eager, n), dynamic=True, fullgraph=True) for n in ("rope_split", "norm")}

    def row(B, T):
        qkv = torch.randn(B, T, GROUPS, GROUP_SIZE + 2, HEAD_DIM, device=device, dtype=torch.bfloat16)
        cos, sin = (torch.randn(T, 1, 1, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(2))
        x = torch.randn(B, T, HIDDEN, device=device, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, device=device, dtype=torch.bfloat16)
        return {
            "batch": B,
            "prompt_len": T,
            "rope_all_symbolic_us": events_time_us(lambda: symbolic["rope_split"](qkv, cos, sin)),
            "rope_engine_us": events_time_us(lambda: engine.rope_split(qkv, cos, sin)),
            "norm_all_symbolic_us": events_time_us(lambda: symbolic["norm"](x, w, None)),
            "norm_engine_us": events_time_us(lambda: engine.norm(x, w, None)),
        }

    return [row(B, T) for B, T in ((512, 128), (64, 200), (8, 37))]


def autotune_rows(device, batches=(64, 256)) -> list[dict]:
    rows = []
    for M in batches:
        for name, (n, k) in GEMM_SHAPES.items():
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            x = torch.randn(M, k, device=device, dtype=torch.bfloat16)
            tuned = torch.compile(lambda x, w: x @ w.t(), mode="max-autotune-no-cudagraphs", dynamic=False)
            tuned(x, w)
            rows.append(
                {
                    "batch": M,
                    "gemm": name,
                    "cublas_us": graph_time_us(lambda x=x, w=w: x @ w.t(), calls=10, replays=50),
                    "autotuned_us": graph_time_us(lambda x=x, w=w, f=tuned: f(x, w), calls=10, replays=50),
                }
            )
    return rows


FP8_WEIGHT_COPIES = 8  # distinct weights cycled per graph: their bytes exceed the L2 cache, as a step's layers do


def per_weight_us(fn, replays: int = 50) -> float:
    """Mean microseconds per call of fn(i), called on each of FP8_WEIGHT_COPIES distinct weights in turn."""
    return graph_time_us(lambda: [fn(i) for i in range(FP8_WEIGHT_COPIES)], 2, replays) / FP8_WEIGHT_COPIES


def _if_it_fits(call):
    """call()'s result, or None where its tiling does not fit this GPU (Triton: out of resource, shared memory)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - only that failure is skipped
        if "out of resource" not in str(exc):
            raise
        return None


def fp8_rows(device, batches=(64, 256)) -> list[dict]:
    """Each weight GEMM in bf16 (x @ W^T) and in FP8 (torch._scaled_mm, e4m3 operands, float32 result) with unit
    (tensor-wise) scales, as FP8 decode weights run it, and with row-wise scales; over FP8_WEIGHT_COPIES distinct
    weights in turn (a single weight would be read from the L2 cache at these sizes)."""
    return [_fp8_row(device, M, name, n, k) for M in batches for name, (n, k) in GEMM_SHAPES.items()]


def _fp8_row(device, M: int, name: str, n: int, k: int) -> dict:
    from aligner.generation.native.fp8 import E4M3, matmul

    one = torch.ones((), device=device)
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(FP8_WEIGHT_COPIES)]
    w8s = [w.to(E4M3) for w in ws]
    x = torch.randn(M, k, device=device, dtype=torch.bfloat16)
    x8 = x.to(E4M3)
    row_scales = (torch.ones(M, 1, device=device), torch.ones(1, n, device=device))

    variants = {
        "bf16": lambda i: x @ ws[i].t(),
        "fp8_unit_scales": lambda i: matmul(x8, w8s[i], one),
        "fp8_row_scales": lambda i: torch._scaled_mm(x8, w8s[i].t(), *row_scales, out_dtype=torch.bfloat16),
    }
    row = {"batch": M, "gemm": name, "bf16_floor_us": 2 * n * k / BANDWIDTH * 1e6}
    for v, fn in variants.items():
        row[f"{v}_us"] = per_weight_us(fn)
    return row


def splitk_tilings(n: int, k: int, batch: int = 64) -> list:
    from aligner.generation.native.splitk import Tiling

    out = []
    block_ms = (None, 256) if batch >= 256 else (None,)
    for bn, bk, splits, warps, stages, swap, bm in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4, 8), (4, 8), (3, 5), (False, True), block_ms
    ):
        t = Tiling(bn, bk, splits, warps, stages, swap, bm)
        programs = n // bn * splits
        if t.fits(n, k) and 64 <= programs <= 1024 and not (warps == 8 and bn == 32) and not (bm and warps == 4):
            out.append(t)
    return out


def splitk_rows(device, batches: tuple[int, ...]) -> list[dict]:
    """cuBLAS's x @ W^T against the split-K kernel over its tilings, each over FP8_WEIGHT_COPIES distinct weights
    (L2-cold, as a step's layers); `with_sum` adds the compiled reduction of the partials (partials.sum(0) in bf16,
    a kernel of its own here: the engine's residual add does it)."""
    reducers = {}  # one compiled reduction per shape of partials (one code object: raise dynamo's limit for it)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)

    def reduce(p):
        if p.shape not in reducers:
            reducers[p.shape] = torch.compile(lambda p: p.sum(0).to(torch.bfloat16), dynamic=False, fullgraph=True)
        return reducers[p.shape](p)

    return [_splitk_row(device, M, name, reduce) for M in batches for name in ("qkv", "proj", "fc1", "fc2")]


def _splitk_row(device, M: int, name: str, reduce) -> dict:
    from aligner.generation.native import splitk

    n, k = GEMM_SHAPES[name]
    ws = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(FP8_WEIGHT_COPIES)]
    x = torch.randn(M, k, device=device, dtype=torch.bfloat16)
    exact = x.float() @ ws[0].float().t()

    row = {"batch": M, "gemm": name, "floor_us": 2 * n * k / BANDWIDTH * 1e6}
    row["cublas_us"] = per_weight_us(lambda i: x @ ws[i].t())
    results = []
    for t in splitk_tilings(n, k, M):
        out = _if_it_fits(lambda t=t: splitk.matmul(x, ws[0], t))
        if out is None:
            continue
        err = float(((out if t.splits == 1 else out.sum(0)).float() - exact).abs().max())
        alone = per_weight_us(lambda i, t=t, out=out: splitk.matmul(x, ws[i], t, out), 30)
        results.append((alone, t, out, err))
    results.sort(key=lambda r: r[0])
    best = []
    for alone, t, out, err in results[:6]:
        both = alone
        if t.splits > 1:
            both = per_weight_us(lambda i, t=t, out=out: reduce(splitk.matmul(x, ws[i], t, out)))
        best.append({"tiling": vars(t), "alone_us": alone, "with_sum_us": both, "max_err": err})
    row["splitk_best"] = sorted(best, key=lambda b: b["with_sum_us"])
    return row


PRODUCTS = {"tf32": (False, False), "qk16": (True, False), "qk16_pv16": (True, True)}  # (NATIVE_QK, NATIVE_PV)


def gated_tilings() -> list:
    from aligner.generation.native.splitk import Tiling

    return [
        Tiling(bn, bk, 1, warps, stages, swap)
        for bn, bk, warps, stages, swap in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 5), (0, 1))
        if not (warps == 8 and bn == 32)
    ]


def gated_rows(device, batches: tuple[int, ...]) -> list[dict]:
    """fc1 and its SwiGLU: cuBLAS's x @ W^T followed by the compiled activation kernel (the engine's default path)
    against splitk.gated_matmul (both in one kernel) over its tilings, each over FP8_WEIGHT_COPIES distinct weights."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    act = torch.compile(lambda h: F.silu(h[:, :FFN]) * h[:, FFN:], dynamic=False, fullgraph=True)
    ws = [torch.randn(2 * FFN, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(FP8_WEIGHT_COPIES)]
    return [_gated_row(torch.randn(M, HIDDEN, device=device, dtype=torch.bfloat16), ws, act) for M in batches]


def _gated_row(x, ws, act) -> dict:
    from aligner.generation.native import splitk

    h = x.float() @ ws[0].float().t()
    exact = F.silu(h[:, :FFN]) * h[:, FFN:]

    row = {"batch": x.shape[0], "floor_us": 2 * 2 * FFN * HIDDEN / BANDWIDTH * 1e6}
    row["cublas_us"] = per_weight_us(lambda i: x @ ws[i].t(), 30)
    row["cublas_act_us"] = per_weight_us(lambda i: act(x @ ws[i].t()), 30)
    row["cublas_act_err"] = float((act(x @ ws[0].t()).float() - exact).abs().max())
    results = []
    for t in gated_tilings():
        out = _if_it_fits(lambda t=t: splitk.gated_matmul(x, ws[0], t))
        if out is None:
            continue
        err = float((out.float() - exact).abs().max())
        us = per_weight_us(lambda i, t=t, out=out: splitk.gated_matmul(x, ws[i], t, out), 30)
        results.append({"tiling": vars(t), "us": us, "max_err": err})
    row["gated_best"] = sorted(results, key=lambda r: r["us"])[:6]
    return row


def attention_product_rows(device) -> list[dict]:
    """The Triton decode attention per layer (us, L2-cold: LAYERS caches in turn) and its max error against float32
    attention, for each setting of its 16-bit products (triton_decode.NATIVE_QK / NATIVE_PV)."""
    from aligner.generation.native import triton_decode

    saved = triton_decode.NATIVE_QK, triton_decode.NATIVE_PV
    rows, scale = [], HEAD_DIM**-0.5
    try:
        for B, filled in ((64, 256), (128, 256), (256, 256), (512, 256), (64, 1024)):
            T = max(384, filled)
            kvs = [torch.randn(2, B, GROUPS, T, HEAD_DIM, device=device, dtype=torch.bfloat16) for _ in range(LAYERS)]
            q = torch.randn(B, GROUPS, GROUP_SIZE + 2, HEAD_DIM, device=device, dtype=torch.bfloat16)[:, :, :GROUP_SIZE]
            pos = torch.full((B,), filled - 1, device=device)
            probs = torch.einsum("bgrd,bgtd->bgrt", q.float(), kvs[0][0, :, :, :filled].float()) * scale
            exact = torch.einsum("bgrt,bgtd->bgrd", probs.softmax(-1), kvs[0][1, :, :, :filled].float())
            row = {"batch": B, "filled_slots": filled}

            def every_layer(q=q, kvs=kvs, pos=pos):
                return [decode_attention(q, kv[0], kv[1], pos, scale) for kv in kvs]

            for name, switches in PRODUCTS.items():
                triton_decode.NATIVE_QK, triton_decode.NATIVE_PV = switches
                row[f"{name}_err"] = float((every_layer()[0].float() - exact).abs().max())
                row[f"{name}_us"] = graph_time_us(every_layer, calls=1, replays=30) / LAYERS
            rows.append(row)
    finally:
        triton_decode.NATIVE_QK, triton_decode.NATIVE_PV = saved
    return rows


class NeedsGPU(RuntimeError):
    pass


def run(
    prefill: bool = False,
    autotune: bool = False,
    fp8: bool = False,
    splitk: tuple[int, ...] = (),
    attention_products: bool = False,
    gated: tuple[int, ...] = (),
) -> dict:
    """`splitk`: the batch sizes of the split-K comparison (none: skipped)."""
    if not torch.cuda.is_available():
        raise NeedsGPU(
            "needs a CUDA GPU: the kernels are timed inside CUDA graphs "
            "(bench_generation.py --tiny is the CPU smoke run)"
        )
    device = torch.device("cuda")
    gemms = gemm_rows(device)
    report = {
        "device": torch.cuda.get_device_name(device),
        "attention": attention_rows(device),
        "gemm": gemms,
        "gemm_per_step_ms": {str(b): per_step_ms(gemms, b) for b in (64, 256, 512)},
    }
    if prefill:
        report["prefill"] = prefill_rows(device)
    if autotune:
        report["gemm_autotune"] = autotune_rows(device)
    if fp8:
        report["gemm_fp8"] = fp8_rows(device)
    if splitk:
        report["gemm_splitk"] = splitk_rows(device, splitk)
    if attention_products:
        report["attention_products"] = attention_product_rows(device)
    if gated:
        report["gated_fc1"] = gated_rows(device, gated)
    return report


def format_report(report: dict) -> str:
    lines = [f"device {report['device']}", "", "attention per layer (us): floor, matmul path, best Triton setting"]
    for row in report["attention"]:
        best = min((v, k[:-3]) for k, v in row.items() if k.startswith("triton") and k.endswith("_us"))
        lines.append(
            f"  B={row['batch']:4d} slots={row['filled_slots']:5d}  floor {row['floor_us']:7.1f}  matmul "
            f"{row['matmul_us']:7.1f} (err {row['matmul_err']:.2g})  triton {best[0]:7.1f} {best[1]} "
            f"(err {row[best[1] + '_err']:.2g})"
        )
    lines += ["", "weight GEMMs per decode step (ms; floor = max(weight read, FLOPs))"]
    for b, sums in report["gemm_per_step_ms"].items():
        lines.append(f"  B={int(b):4d}  " + "  ".join(f"{k} {v:.3f}" for k, v in sums.items()))
    if "prefill" in report:
        lines += ["", "prefill per call (us): RoPE + split, RMSNorm; every size symbolic -> batch and width dynamic"]
        for r in report["prefill"]:
            lines.append(
                f"  {r['batch']:4d} x {r['prompt_len']:4d}  rope {r['rope_all_symbolic_us']:8.1f} -> "
                f"{r['rope_engine_us']:8.1f}  norm {r['norm_all_symbolic_us']:8.1f} -> {r['norm_engine_us']:8.1f}"
            )
    if "gemm_autotune" in report:
        title = "weight GEMMs (us): cuBLAS x @ W^T vs inductor max-autotune"
        lines += _gemm_table(title, report["gemm_autotune"], ("cublas_us", "autotuned_us"))
    if "gemm_fp8" in report:
        title = "weight GEMMs over distinct weights (us): bf16 floor, bf16, FP8 unit scales, FP8 row scales"
        keys = ("bf16_floor_us", "bf16_us", "fp8_unit_scales_us", "fp8_row_scales_us")
        lines += _gemm_table(title, report["gemm_fp8"], keys)
    if "gemm_splitk" in report:
        lines += ["", "weight GEMMs over distinct weights (us): floor, cuBLAS, split-K alone / with its sum, tiling"]
        for r in report["gemm_splitk"]:
            b = r["splitk_best"][0]
            t = b["tiling"]
            tiling = f"n{t['block_n']} k{t['block_k']} s{t['splits']} w{t['num_warps']} st{t['num_stages']}"
            tiling += (" swap" if t["swap"] else "") + (f" m{t['block_m']}" if t.get("block_m") else "")
            lines.append(
                f"  B={r['batch']:4d} {r['gemm']:6s} {r['floor_us']:7.1f} {r['cublas_us']:7.1f} {b['alone_us']:7.1f}"
                f" / {b['with_sum_us']:7.1f}  {tiling} (err {b['max_err']:.2g})"
            )
    if "attention_products" in report:
        lines += ["", "Triton attention per layer (us; max error): " + ", ".join(PRODUCTS)]
        for r in report["attention_products"]:
            cells = "  ".join(f"{r[n + '_us']:7.1f} ({r[n + '_err']:.2g})" for n in PRODUCTS)
            lines.append(f"  B={r['batch']:4d} slots={r['filled_slots']:5d}  {cells}")
    if "gated_fc1" in report:
        lines += ["", "fc1 + SwiGLU over distinct weights (us): floor, cuBLAS alone, cuBLAS + act, one gated kernel"]
        for r in report["gated_fc1"]:
            b = r["gated_best"][0]
            t = b["tiling"]
            tiling = f"n{t['block_n']} k{t['block_k']} w{t['num_warps']} st{t['num_stages']}" + (" swap" * t["swap"])
            lines.append(
                f"  B={r['batch']:4d} {r['floor_us']:7.1f} {r['cublas_us']:7.1f} {r['cublas_act_us']:7.1f} "
                f"{b['us']:7.1f}  {tiling} (err {b['max_err']:.2g} vs {r['cublas_act_err']:.2g})"
            )
    return "\n".join(lines)


def _gemm_table(title: str, rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    cells = ("  ".join(f"{r[k]:7.1f}" for k in keys) for r in rows)
    return ["", title] + [f"  B={r['batch']:4d} {r['gemm']:6s}  {c}" for r, c in zip(rows, cells)]
