"""Probe (issue 17, twenty-sixth session): a decode step's GEMMs above 128 rows, cuBLAS against the Triton kernels in
blocks of rows.

Above 128 rows (the split-K kernels' one-block limit) the engine ran every FP8 decode GEMM by cuBLAS. Here, at
--rows rows (default 256: the benchmark's larger batch), every layer's distinct weights of the 1B model (--preset 8b:
the 8B shape's) in one CUDA graph (L2-cold, as in a step), us a layer:

- cuBLAS, as the engine calls it there: fc1 (fp8.matmul, unit scales, bf16 out: the compiled activation kernel after
  it applies the scales), fc2 (float32 out), qkv and the output layer (fp8.matmul_rowwise, scales in the epilogue),
  proj in bf16 (F.linear);
- the Triton kernels (splitk.py) in blocks of rows over a few tilings each (CANDIDATES; the engine's first);
- the row kernels each path needs after it: the activation's quantization after the gated fc1, the add+norm with the
  split-K partials after fc2 (the cuBLAS path's are compiled kernels: see docs/PERF.md's profiles).

Every Triton row's largest error against float32 maths of the same e4m3 values (relative to the product's largest
value) is reported with it.

    python3 benchmarks/probes/fp8_row_blocks.py --rows 256 [--preset 8b] --out result.json     (CUDA, sm_89+)
    TRITON_INTERPRET=1 python3 benchmarks/probes/fp8_row_blocks.py --tiny          (CPU: errors only)
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import us_a_layer, write_report  # noqa: E402

TINY = (2, 64, 128, 128, 256)


def shapes(preset: str) -> tuple[int, int, int, int, int]:
    """(layers, hidden, ffn, qkv rows, vocabulary) of a benchmarks/shapes.py model (1b: the one of docs/PERF.md)."""
    from benchmarks.shapes import PRESETS

    p = PRESETS[preset]
    head_dim = p["hidden_size"] // p["num_attention_heads"]
    qkv = p["hidden_size"] + 2 * p["num_query_groups"] * head_dim
    return p["num_layers"], p["hidden_size"], p["ffn_hidden_size"], qkv, p["vocab_size"]


# (block_m, block_n, block_k, splits, warps, stages): the engine's tiling comes first, then what the session tried
# next to it (docs/PERF.md, twenty-sixth session)
CANDIDATES = {
    "fc1": [None, (128, 64, 128, 1, 4, 3), (128, 128, 128, 1, 8, 3), (256, 64, 128, 1, 8, 3), (128, 64, 128, 1, 8, 4)],
    # wider column blocks (forty-second session): at the 8B shape (K = 4096) each program's rows of x are 512 KiB, read
    # again by every column block; the 8B step's qkv ran at 2.8x its weight's bytes (docs/PERF.md)
    "qkv": [
        None,
        (128, 64, 128, 1, 8, 5),
        (128, 64, 128, 1, 8, 4),
        (128, 64, 256, 1, 8, 3),
        (128, 32, 128, 1, 4, 4),
        (256, 64, 128, 1, 8, 3),
    ]
    + [(128, 128, 128, 1, 8, 3), (256, 128, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3)],
    "fc2": [(128, 64, 128, 4, 4, 4), (128, 64, 128, 4, 8, 4), (128, 64, 128, 2, 8, 4), (256, 64, 128, 4, 8, 3)],
    "out": [(128, 64, 128, 1, 8, 4), (128, 128, 128, 1, 8, 3), (256, 128, 128, 1, 8, 3)],
    "proj": [(128, 64, 128, 2, 4, 3), (128, 64, 64, 4, 4, 4), (256, 64, 64, 4, 8, 3)],
}


def _triton_call(name: str, tiling, W: list, a8, a_s, x, act: torch.dtype):
    """fn(layer) calling the Triton kernel for `name` with `tiling` on that layer's weight."""
    from aligner.generation.native import splitk

    if name == "fc1":
        return lambda i: splitk.gated_matmul_fp8(a8, a_s, *W[i], tiling, act)
    if name == "proj":
        return lambda i: splitk.matmul(x, W[i], tiling)
    dtype = act if tiling.splits == 1 and name != "fc2" else torch.float32
    return lambda i: splitk.matmul_fp8(a8, a_s, *W[i], tiling, dtype)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument(
        "--preset", choices=("1b", "8b"), default="1b", help="the model's shapes (benchmarks/shapes.py)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU: 2 layers, small sizes, errors only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from aligner.generation.native import fp8, rows, splitk
    from aligner.generation.native.splitk import Tiling

    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if gpu else "cpu")
    L, H, FF, NQ, V = shapes(args.preset) if not args.tiny else TINY
    M = args.rows if not args.tiny else 40
    act = torch.bfloat16 if gpu else torch.float32  # the interpreter: float32 only
    g = torch.Generator(device=device).manual_seed(0)

    def e4m3(n, k):
        w8, ws = fp8.quantize_rows(torch.randn(n, k, generator=g, device=device) * 0.02)
        return w8, ws.view(-1).contiguous()

    x8, xs = fp8.quantize_rows(torch.randn(M, H, generator=g, device=device))
    m8, ms = fp8.quantize_rows(torch.randn(M, FF, generator=g, device=device))
    x = torch.randn(M, H, generator=g, device=device).to(act)
    m = torch.randn(M, FF, generator=g, device=device).to(act)
    weights = {
        "fc1": [e4m3(2 * FF, H) for _ in range(L)],
        "qkv": [e4m3(NQ, H) for _ in range(L)],
        "fc2": [e4m3(H, FF) for _ in range(L)],
        # 4 distinct output weights in turn (each 64 MB, over the L2's 50) rather than 16 (1 GB)
        "out": [e4m3(V, H) for _ in range(min(L, 4))] * (L // min(L, 4)),
        "proj": [(torch.randn(H, H, generator=g, device=device) * 0.02).to(act) for _ in range(L)],
    }
    inputs = {"fc1": (x8, xs), "qkv": (x8, xs), "out": (x8, xs), "fc2": (m8, ms)}
    one = torch.ones((), device=device)
    report = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "args": vars(args), "us": {}, "err": {}}

    def record(name, fn, ref=None, parts=False):
        if ref is not None:
            y = fn(0).float()
            y = y.sum(0) if parts else y
            report["err"][name] = float((y - ref).abs().max() / ref.abs().max())
        report["us"][name] = us_a_layer(lambda: [fn(i) for i in range(L)], L, gpu)
        err = f"  err {report['err'][name]:.1e}" if name in report["err"] else ""
        print(f"{name:48s} {report['us'][name]:9.2f} us{err}", flush=True)

    if gpu:  # cuBLAS, as the engine calls it above 128 rows
        record("fc1 cublas", lambda i: fp8.matmul(x8, weights["fc1"][i][0], one, act))
        record("fc2 cublas", lambda i: fp8.matmul(m8, weights["fc2"][i][0], one))
        for name in ("qkv", "out"):
            record(f"{name} cublas", lambda i, w=weights[name]: fp8.matmul_rowwise(x8, xs, *w[i], act))
        record("proj cublas", lambda i: F.linear(x, weights["proj"][i]))
    record("quantize_rows (after the gated fc1)", lambda i: rows.quantize_rows(m))
    resid, norm_w = torch.randn(M, H, generator=g, device=device).to(act), torch.ones(H, device=device, dtype=act)
    for S in (1, 4):
        partials = torch.randn(S, M, H, generator=g, device=device)
        record(
            f"add_parts_norm_q S={S} (after fc2)",
            lambda i, p=partials: rows.add_parts_norm(resid, p, None, norm_w, 1e-5, True),
        )

    def exact(a8, a_s, w8, w_s):
        return (a8.float() * a_s.view(-1, 1)) @ (w8.float() * w_s.view(-1, 1)).t()

    sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else None
    engine = {  # as the decoder asks for them (splitk.one_wave: the stages fitted to this GPU)
        "fc1": splitk.one_wave(splitk.fp8_gated_tiling_for(M, 2 * FF, H), M, 2 * FF, 1, sms, gated=True),
        "qkv": splitk.one_wave(splitk.fp8_product_tiling_for(M, NQ, H, row_blocks=True), M, NQ, 1, sms),
    }
    for name, candidates in CANDIDATES.items():
        a8, a_s = inputs.get(name, (None, None))
        w0 = weights[name][0]
        if name == "fc1":
            y = exact(a8, a_s, *w0)
            ref = F.silu(y[:, :FF]) * y[:, FF:]
        elif name == "proj":
            ref = x.float() @ w0.float().t()
        else:
            ref = exact(a8, a_s, *w0)
        for c in candidates if not args.tiny else candidates[:2]:  # the interpreter: the engine's and one more
            if c is None:
                tiling = engine[name]
                if tiling is None:
                    continue
                label = f"{name} (engine) bm{tiling.block_m} bn{tiling.block_n} bk{tiling.block_k} S{tiling.splits} "
                label += f"w{tiling.num_warps} st{tiling.num_stages}"
            else:
                bm, bn, bk, S, w, st = c if not args.tiny else (16, 16, 16, c[3], c[4], c[5])
                tiling = Tiling(bn, bk, S, w, st, block_m=bm)
                label = f"{name} bm{bm} bn{bn} bk{bk} S{S} w{w} st{st}"
            fn = _triton_call(name, tiling, weights[name], a8, a_s, x, act)
            try:
                record(label, fn, ref, parts=tiling.splits > 1)
            except Exception as exc:  # noqa: BLE001 - a tiling this GPU cannot compile: reported, the rest go on
                print(f"{label:48s} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                report["us"][label] = None
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
