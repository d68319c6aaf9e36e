"""Probe (issue 17, twenty-fifth session): the Triton decode attention called as a decode step calls it, alone.

In a profile of a decode step at 256 rows with FP8 weights (docs/PERF.md, twenty-fifth session) the attention kernel
took 78 us a layer, against 66 in the eighteenth session's loop over 16 layers' caches (its read floor: 64). What the
engine's call has that the loop had not, each added in turn here (16 layers in one CUDA graph, us a layer):

- `separate`: 16 cache tensors [2, B, G, T, D] (the loop's), q a contiguous [B, G, r, D];
- `one_cache`: the layers' views of one cache [L, 2, B, G, T, D], as the engine allocates it;
- `strided_q`: q a view of the qkv projection's rows [B, G, r + 2, D];
- `engine`: also the step's key and value from those rows, written by the kernel, and RoPE applied to q and the key
  (the engine's call up to triton_decode.FUSED_WRITE_MAX_BATCH rows), with PDL where the engine takes it;
- `engine_no_pdl`: the same without PDL; `engine_block64`: with 64 slots a step.

With --sweep also the engine's call with every setting of slots per inner step, warps and pipeline stages given
(rows named "block,warps,stages").

Every variant attends over the same values (the step's own key and value are those already in slot `pos`), so all
must give the same output: checked, and the largest difference reported.

    python3 benchmarks/probes/attention_in_step.py --batch-sizes 64 256 --out result.json
    python3 benchmarks/probes/attention_in_step.py --batch-sizes 64 256 512 --sweep   (settings, twenty-sixth session)
    TRITON_INTERPRET=1 python3 benchmarks/probes/attention_in_step.py --tiny     (CPU: outputs compared only)
"""

import argparse
import itertools
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import us_a_layer, write_report  # noqa: E402

LAYERS, GROUPS, GROUP_SIZE, HEAD_DIM = 16, 8, 2, 128  # the 1B model of docs/PERF.md
BANDWIDTH = 4.2e12  # the H200's copy rate (docs/PERF.md)


def _inputs(B: int, filled: int, T: int, L: int, G: int, r: int, D: int, device, dtype):
    """One cache [L, 2, B, G, T, D] with `filled` slots per row, the qkv rows [B, G, r + 2, D] whose key and value
    equal slot filled - 1 of layer 0's cache (so writing them changes nothing), RoPE's tables at cos 1, sin 0 (the
    identity: the rotated key is the key already cached)."""
    g = torch.Generator(device=device).manual_seed(0)
    kv = torch.zeros(L, 2, B, G, T, D, dtype=dtype, device=device)
    for i in range(L):
        kv[i, :, :, :, :filled] = torch.randn(2, B, G, filled, D, generator=g, device=device).to(dtype)
    qkv5 = torch.randn(B, G, r + 2, D, generator=g, device=device).to(dtype)
    pos = torch.full((B,), filled - 1, device=device)
    cos = torch.ones(B, D, dtype=dtype, device=device)
    sin = torch.zeros(B, D, dtype=dtype, device=device)
    return kv, qkv5, pos, (cos, sin)


def variants(kv, qkv5, pos, rope, r: int) -> dict:
    """name -> fn(layer) calling the kernel for that layer as the variant says."""
    from aligner.generation.native import pdl
    from aligner.generation.native.triton_decode import decode_attention

    scale = kv.shape[-1] ** -0.5
    L = kv.shape[0]
    q_strided = qkv5[:, :, :r]
    q_contig = q_strided.contiguous()
    separate = [kv[i].clone() for i in range(L)]
    new = (qkv5[:, :, r], qkv5[:, :, r + 1])

    def engine(i, block=None, warps=4, stages=None):
        return decode_attention(
            q_strided, kv[i, 0], kv[i, 1], pos, scale, 1, block, warps, new_kv=new, num_stages=stages, rope=rope
        )

    def engine_no_pdl(i):
        enabled, pdl.ENABLED = pdl.ENABLED, False
        try:
            return engine(i)
        finally:
            pdl.ENABLED = enabled

    # the step's own key and value: put them in every layer's slot pos, so every variant attends to the same values
    b = torch.arange(kv.shape[2], device=kv.device)
    for i in range(L):
        for c in range(2):
            kv[i, c, b, :, pos] = new[c]
            separate[i][c, b, :, pos] = new[c]
    return {
        "separate": lambda i: decode_attention(q_contig, separate[i][0], separate[i][1], pos, scale),
        "one_cache": lambda i: decode_attention(q_contig, kv[i, 0], kv[i, 1], pos, scale),
        "strided_q": lambda i: decode_attention(q_strided, kv[i, 0], kv[i, 1], pos, scale),
        "engine": engine,
        "engine_no_pdl": engine_no_pdl,
        "engine_block64": lambda i: engine(i, 64),
        "_settings": engine,  # engine(i, block, warps, stages): the --sweep's calls (not a variant of its own)
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--filled", type=int, default=256, help="cached slots per row (the benchmark's average)")
    parser.add_argument("--max-seq", type=int, default=384, help="slots per row in the cache (the engine's max_seq)")
    parser.add_argument("--tiny", action="store_true", help="CPU: 2 layers, small sizes, outputs compared only")
    parser.add_argument(
        "--sweep", action="store_true", help="also the engine's call over --blocks x --warps x --stages"
    )
    parser.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128], help="slots per inner step")
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 5], help="software pipeline stages")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if gpu else "cpu")
    L, G, r, D = (LAYERS, GROUPS, GROUP_SIZE, HEAD_DIM) if not args.tiny else (2, 2, GROUP_SIZE, 16)
    filled, T = (args.filled, args.max_seq) if not args.tiny else (9, 16)
    dtype = torch.bfloat16 if gpu else torch.float32  # the interpreter: float32 only
    report = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "args": vars(args), "batches": {}}
    for B in args.batch_sizes:
        kv, qkv5, pos, rope = _inputs(B, filled, T, L, G, r, D, device, dtype)
        calls = variants(kv, qkv5, pos, rope, r)
        settings = calls.pop("_settings")
        if args.sweep:  # the engine's call with each setting: "block,warps,stages"
            for block, warps, stages in itertools.product(args.blocks, args.warps, args.stages):
                calls[f"{block},{warps},{stages}"] = partial(settings, block=block, warps=warps, stages=stages)
        ref = calls["separate"](0).float()
        row = {"floor_us": 2 * B * G * filled * D * kv.element_size() / BANDWIDTH * 1e6, "max_diff": {}, "us": {}}
        for name, fn in list(calls.items()):
            try:
                row["max_diff"][name] = float((fn(0).float() - ref).abs().max())
            except Exception as exc:  # noqa: BLE001 - a setting this GPU cannot build (shared memory): reported
                if "," not in name:
                    raise
                print(f"  {name:16s} failed: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                del calls[name]
                continue
            row["us"][name] = us_a_layer(lambda fn=fn: [fn(i) for i in range(L)], L, gpu)
        report["batches"][str(B)] = row
        print(f"B={B} floor {row['floor_us']:.1f} us a layer", flush=True)
        for name in calls:
            print(f"  {name:16s} {row['us'][name]:9.2f} us  (max diff {row['max_diff'][name]:.2g})", flush=True)
        del kv, calls
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
