"""Probe (issue 17, twenty-eighth session): the FP8 KV cache's values stored in chunks of slots, against rows.

The decode attention with an e4m3 cache ran at about twice its (halved) read floor (docs/PERF.md, eighteenth
session): bound by instructions, not bytes. Its compiled code (sm_90, Triton 3.6) shows where: the product p v takes
V as the tensor cores' second operand, which wants several consecutive slots of one dimension in each register;
with values stored as rows [T, D] those bytes lie D apart, and the kernel gathers them one byte at a time from shared
memory (128 ld.shared.b8 a thread and step of 128 slots, then byte shuffles). Stored in chunks [T / C, D, C] (slot t,
dimension d at (t // C, d, t % C)) they are C contiguous bytes: copied to shared memory 16 bytes at a time and read by
ldmatrix, as 16-bit values are. The step's own value is then written as D single bytes C apart (4 C sectors of 32
bytes touched, against 4 for a row), which costs DRAM traffic of its own: hence several C.

Timed, 16 layers in one CUDA graph, us a layer, each as the engine calls the kernel (the step's key and value from
the qkv rows, written by the kernel, RoPE, PDL where the engine takes it): the bf16 cache; the FP8 cache in rows; the
FP8 cache with values in chunks of each --chunks, with each --blocks slots per inner step. --ragged spreads the rows'
positions over [filled / 2, 3 filled / 2), as a generate call's steps do (a step of 128 slots costs its width however
few it holds: 65 against 56 us a layer at 256 rows, twenty-eighth session). Every FP8 form attends to the same
values, so their outputs must be equal (checked: max difference to the rows form), and the rows form is compared with
float32 attention over the dequantized cache.

    python3 benchmarks/probes/fp8_cache_layout.py --batch-sizes 64 256 --out result.json
    python3 benchmarks/probes/fp8_cache_layout.py --ragged --chunks 64 --blocks 64 128 --stages 2   (a call's spread)
    python3 benchmarks/probes/fp8_cache_layout.py --ragged --chunks 64 --blocks 64 128 --warps 2 4 --stages 2 \
        --maxnreg 0 128 168 --exp2 0 1 --warp-slots 0 1     (the twenty-ninth session's candidates, whose compiled
                                                             code attention_code.py shows)
    TRITON_INTERPRET=1 python3 benchmarks/probes/fp8_cache_layout.py --tiny     (CPU: outputs compared only)
"""

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import us_a_layer, write_report  # noqa: E402

LAYERS, GROUPS, GROUP_SIZE, HEAD_DIM = 16, 8, 2, 128  # the 1B model of docs/PERF.md
BANDWIDTH = 4.2e12  # the H200's copy rate (docs/PERF.md)


def chunked(values: torch.Tensor, chunk: int) -> torch.Tensor:
    """Values [..., T, D] -> a copy in chunks [..., T / chunk, D, chunk] (the engine's writer)."""
    from aligner.generation.native.triton_decode import write_value_chunks

    *lead, T, D = values.shape
    out = torch.empty(*lead, T // chunk, D, chunk, dtype=values.dtype, device=values.device)
    write_value_chunks(out, values)
    return out


def _batch(B: int, args, gpu: bool, device, tiny_dims) -> dict:
    """Every form timed and compared at batch size B (the report's row)."""
    from aligner.generation.native.triton_decode import decode_attention, quantize_fp8

    L, G, r, D = tiny_dims or (LAYERS, GROUPS, GROUP_SIZE, HEAD_DIM)
    filled, T = (args.filled, args.max_seq) if tiny_dims is None else (9, 32)
    act = torch.bfloat16 if gpu else torch.float32  # the interpreter: float32 only
    scale = D**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    kv = torch.empty(L, 2, B, G, T, D, device=device, dtype=act)
    for i in range(L):  # every slot finite (the chunked forms read whole chunks), a layer at a time (memory)
        kv[i] = torch.randn(2, B, G, T, D, generator=g, device=device).to(act)
    qkv5 = torch.randn(B, G, r + 2, D, generator=g, device=device).to(act)
    q, new = qkv5[:, :, :r], (qkv5[:, :, r], qkv5[:, :, r + 1])
    pos = torch.full((B,), filled - 1, device=device)
    if args.ragged:  # as in a generate call's steps: prompts of filled / 2 slots plus 0 .. filled new tokens
        pos = filled // 2 - 1 + torch.arange(B, device=device) * filled // B
    rope = (torch.ones(B, D, dtype=act, device=device), torch.zeros(B, D, dtype=act, device=device))
    kv8, scales = quantize_fp8(kv)
    calls = {}
    if gpu:  # the engine's bf16 cache, for the times (its outputs differ by the FP8 rounding)
        calls["bf16"] = lambda i: decode_attention(q, kv[i, 0], kv[i, 1], pos, scale, new_kv=new, rope=rope)
    k8 = {"rows": kv8[:, 0].clone()}
    v8 = {"rows": kv8[:, 1].clone()}
    sc = {"rows": scales.clone()}
    for c in args.chunks:
        k8[c], v8[c], sc[c] = kv8[:, 0].clone(), chunked(kv8[:, 1], c), scales.clone()
    del kv8
    forms = itertools.product(
        args.blocks, args.warps, args.stages, args.maxnreg, args.exp2, args.warp_slots, args.r_pad,
        ["rows", *args.chunks],
    )  # fmt: skip
    for block, warps, stages, cap, exp2, own, r_pad, form in forms:
        if own and (block % warps or block // warps < 16):  # decode_attention refuses it
            continue
        name = f"fp8_{'rows' if form == 'rows' else f'chunk{form}'}_b{block}"
        name += "" if (warps, stages) == (4, 0) else f"_w{warps}_s{stages}"
        name += (f"_r{cap}" if cap else "") + ("_exp2" if exp2 else "") + ("_own" if own else "")
        name += f"_q{r_pad}" if r_pad else ""

        def call(i, form=form, block=block, warps=warps, stages=stages, cap=cap, exp2=exp2, own=own, r_pad=r_pad):
            s = sc[form]
            return decode_attention(
                q, k8[form][i], v8[form][i], pos, scale, 1, block, warps, new_kv=new, rope=rope,
                kv_scales=(s[i, 0], s[i, 1]), num_stages=stages or None, exp2=bool(exp2), maxnreg=cap,
                warp_slots=bool(own), r_pad=r_pad or None,
            )  # fmt: skip

        calls[name] = call
    # every form writes the step's key and value (the same quantized values) in its first call, so the second
    # calls attend to equal caches
    for name, fn in list(calls.items()):
        try:
            fn(0)
        except Exception as exc:  # noqa: BLE001 - a setting this GPU cannot build (shared memory): reported
            print(f"  {name:20s} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            del calls[name]
    outs = {name: fn(0).float() for name, fn in calls.items()}
    first = next(name for name in outs if name.startswith("fp8_rows"))
    k_deq = k8["rows"][0].float() * sc["rows"][0, 0, ..., None]
    v_deq = v8["rows"][0].float() * sc["rows"][0, 1, ..., None]
    scores = torch.einsum("bgrd,bgtd->bgrt", q.float(), k_deq) * scale
    beyond = torch.arange(T, device=device)[None, None, None, :] > pos[:, None, None, None]
    ref = torch.einsum("bgrt,bgtd->bgrd", scores.masked_fill(beyond, float("-inf")).softmax(-1), v_deq)
    row = {
        "floor_us": {
            "bf16": 2 * G * int((pos + 1).sum()) * D * 2 / BANDWIDTH * 1e6,  # the slots read: pos + 1 per row
            "fp8": 2 * G * int((pos + 1).sum()) * (D + 4) / BANDWIDTH * 1e6,
        },
        "max_diff_to_rows": {n: float((o - outs[first]).abs().max()) for n, o in outs.items() if "fp8" in n},
        "rows_vs_float32": float((outs[first] - ref).abs().max()),
        "us": {},
    }
    for name, fn in calls.items():
        row["us"][name] = us_a_layer(lambda fn=fn: [fn(i) for i in range(L)], L, gpu)
    f = row["floor_us"]
    print(f"B={B} floor {f['bf16']:.1f} us a layer (bf16), {f['fp8']:.1f} (e4m3 + scales); rows vs float32 "
          f"{row['rows_vs_float32']:.3g}", flush=True)  # fmt: skip
    for name in calls:
        diff = row["max_diff_to_rows"].get(name)
        print(f"  {name:20s} {row['us'][name]:9.2f} us" + ("" if diff is None else f"  (diff {diff:.2g})"))
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--filled", type=int, default=256, help="cached slots per row (the benchmark's average)")
    parser.add_argument("--max-seq", type=int, default=384, help="slots per row in the cache (the engine's max_seq)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16, 32], help="slots per chunk of values")
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 128], help="slots per inner step (FP8)")
    parser.add_argument("--warps", type=int, nargs="+", default=[4])
    parser.add_argument("--stages", type=int, nargs="+", default=[0], help="pipeline stages (0: Triton's default)")
    parser.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps (0: none)")
    parser.add_argument("--exp2", type=int, nargs="+", default=[0], help="softmax in base 2 (0 / 1)")
    parser.add_argument("--warp-slots", type=int, nargs="+", default=[0], help="1: each warp its own slots (0 / 1)")
    parser.add_argument(
        "--r-pad", type=int, nargs="+", default=[0], help="query rows a product holds (0: the engine's FP8_R_PAD)"
    )
    parser.add_argument(
        "--ragged", action="store_true", help="row b holds filled / 2 + b * filled / B slots (a call's spread)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU: 2 layers, small sizes, outputs compared only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if gpu else "cpu")
    tiny_dims = (2, 2, GROUP_SIZE, 16)
    report = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "args": vars(args), "batches": {}}
    for B in args.batch_sizes:
        report["batches"][str(B)] = _batch(B, args, gpu, device, tiny_dims if args.tiny else None)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
