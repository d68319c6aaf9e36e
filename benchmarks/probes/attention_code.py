"""Probe (issue 17, twenty-ninth session): the decode attention kernel's compiled code for the H200, without a GPU.

Triton compiles for sm_90 on any machine (its wheel ships ptxas, cuobjdump and nvdisasm): this builds the engine's
decode attention kernel as a decode step of the benchmark's 1B model calls it (2 query heads a group, head width 128,
the step's key and value written by the kernel, RoPE, PDL; the divisibility hints Triton's JIT gives aligned
pointers and strides) and reports for each setting what the GPU's scheduler gets:
- registers a thread, local memory (spills) and shared memory;
- programs an SM can hold: the least of what its registers (65,536), shared memory (228 KB, 1 KB reserved a
  program), warps (64) and programs (32) allow; fewer programs at once leave fewer warps to hide latencies;
- the slot loop's instructions (one step of BLOCK slots, one warp), counted by kind (BAR: the barriers at which a
  program's warps wait for each other; STS / LDS: shared memory, where its warps exchange the scores' row maxima
  and sums and the probabilities).
The FP8 cache's kernel was found at 168 registers a thread (3 programs an SM), the softmax in base 2 at 200 (2), which
is why that change measured faster at 64 rows and slower at 256 (docs/PERF.md, twenty-ninth session).

    python3 benchmarks/probes/attention_code.py                   (FP8 cache, the engine's settings at 64 rows)
    python3 benchmarks/probes/attention_code.py --rows 256        (... at 256 rows: triton_decode.fp8_launch)
    python3 benchmarks/probes/attention_code.py --maxnreg 0 128 --exp2 0 1 --out result.json
    python3 benchmarks/probes/attention_code.py --kv bf16 --blocks 32 64 --stages 3
    python3 benchmarks/probes/attention_code.py --rows 256 --r-pad 16 8 4   (query rows a product holds)
    python3 benchmarks/probes/attention_code.py --rows 256 --bits-cvt 0 1   (e4m3 -> float16 by bit operations)
"""

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import write_report  # noqa: E402

GROUP_SIZE, HEAD_DIM = 2, 128  # the 1B model of docs/PERF.md
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_PROGRAMS, RESERVED_SHARED = 65536, 233472, 64, 32, 1024  # an H100/H200 SM
KINDS = ("HMMA", "F2FP", "MUFU", "FMUL", "FFMA", "LDS", "LDSM", "STS", "MOV", "BAR", "STL", "LDL")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def _signature(kernel, kv: str) -> tuple[dict, dict]:
    """The kernel's argument types as the engine passes them (bf16 activations), and the JIT's divisibility hints
    (pointers and strides: multiples of 16)."""
    cache = "*fp8e4nv" if kv == "fp8" else "*bf16"
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        param = kernel.params[i]
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in ("k_ptr", "v_ptr"):
            signature[name] = cache
        elif name in ("ks_ptr", "vs_ptr"):
            signature[name] = "*fp32" if kv == "fp8" else "*bf16"
        elif name in ("pos_ptr", "lead_ptr", "shared_ptr", "row_from_ptr"):
            signature[name] = "*i64"
        elif name == "chunk_ptr":
            signature[name] = "*i32"
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        elif name in ("scale", "eps"):
            signature[name] = "fp32"
        else:  # strides
            signature[name] = "i32"
        if signature[name].startswith("*") or signature[name] == "i32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def slot_loop(sass: str) -> collections.Counter:
    """The instructions of the longest backward branch's body (the slot loop), counted by opcode (the name before
    its first dot; IMAD.MOV counted as MOV: both copy a register)."""
    lines, labels, best = sass.splitlines(), {}, collections.Counter()
    for i, line in enumerate(lines):
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if branch and branch.group(1) in labels:
            ops = collections.Counter()
            for body_line in lines[labels[branch.group(1)] : i + 1]:
                m = _INSTRUCTION.match(body_line)
                if m:
                    op = m.group(1)
                    ops["MOV" if op.startswith("IMAD.MOV") else op.split(".")[0]] += 1
            if sum(ops.values()) > sum(best.values()):
                best = ops
    return best


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
    """How many programs of `warps` warps an SM holds, by each limit (registers allocated 256 a warp at a time)."""
    per_warp = -(-registers * 32 // 256) * 256
    by = {
        "registers_limit": SM_REGISTERS // (per_warp * warps),
        "shared_limit": SM_SHARED // (shared + RESERVED_SHARED),
        "warps_limit": min(SM_WARPS // warps, SM_PROGRAMS),
    }
    return {**by, "programs": min(by.values())}


def compile_one(
    kv: str,
    block: int,
    warps: int,
    stages: int,
    maxnreg: int,
    exp2: bool,
    warp_slots: bool,
    shared: bool = False,
    groups: bool = False,
    r_pad: int = 16,
    bits_cvt: bool = False,
) -> dict:
    """One setting compiled for sm_90: its resources and its slot loop."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aligner.generation.native import triton_decode

    kernel = triton_decode._kernels()[0]
    signature, attrs = _signature(kernel, kv)
    constexprs = dict(
        R=GROUP_SIZE, D=HEAD_DIM, R_PAD=16 if groups else max(r_pad, GROUP_SIZE), D_PAD=HEAD_DIM, BLOCK=block,
        SPLIT_LEN=384, SPLITS=1, PRECISION="tf32",
        WRITE_NEW=True, ROPE=True, NATIVE_QK=True, NATIVE_PV=True, KV_FP8=kv == "fp8", PDL=True,
        V_CHUNK=triton_decode.V_CHUNK if kv == "fp8" else 0, EXP2=exp2, WARP_SLOTS=warps if warp_slots else 0,
        SHARED=shared or groups, GROUPS=groups, BITS_CVT=bits_cvt, QK_NORM=False, ROTATED=0,
    )  # fmt: skip
    options = dict(num_warps=warps, num_stages=stages)
    if maxnreg:
        options["maxnreg"] = maxnreg
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    resources = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage.stdout)}
    shared = compiled.metadata.shared
    loop = slot_loop(sass)
    return {
        "r_pad": constexprs["R_PAD"],
        "registers": resources["reg"],
        "stack_bytes": resources.get("stack", 0) + resources.get("local", 0),
        "shared_bytes": shared,
        **programs_per_sm(resources["reg"], shared, warps),
        "loop_instructions": sum(loop.values()),
        "loop": {kind: loop.get(kind, 0) for kind in KINDS},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="the cache's dtype")
    parser.add_argument("--rows", type=int, default=64, help="the batch size whose engine settings are the defaults")
    parser.add_argument("--blocks", type=int, nargs="+", default=None, help="slots a step (default: the engine's)")
    parser.add_argument("--warps", type=int, nargs="+", default=None, help="default: the engine's")
    parser.add_argument("--stages", type=int, nargs="+", default=None, help="default: the engine's (FP8: 2, else 3)")
    parser.add_argument(
        "--maxnreg", type=int, nargs="+", default=None, help="register caps (0: none; default: the engine's)"
    )
    parser.add_argument(
        "--exp2", type=int, nargs="+", default=None, help="0: natural-base softmax, 1: base 2 (default: the engine's)"
    )
    parser.add_argument("--warp-slots", type=int, nargs="+", default=[0], help="1: each warp its own slots a step")
    parser.add_argument("--shared", type=int, nargs="+", default=[0], help="1: a group's prompt read from one row")
    parser.add_argument(
        "--groups", type=int, nargs="+", default=[0], help="1: a group's prompt attended once for its rows (+ shared)"
    )
    parser.add_argument(
        "--r-pad", type=int, nargs="+", default=None, help="query rows a product holds (default: the engine's)"
    )
    parser.add_argument(
        "--bits-cvt", type=int, nargs="+", default=[0], help="1: e4m3 -> float16 by bit operations (FP8_BITS_CVT)"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)  # compiling needs it off (the test suite's conftest sets it)
    from aligner.generation.native import triton_decode

    fp8 = args.kv == "fp8"
    if fp8:  # the engine's launch at --rows rows
        engine = {**triton_decode.fp8_launch(args.rows), "r_pad": triton_decode.FP8_R_PAD}
    else:  # a bf16 cache: the wide step, 4 warps, 3 stages, no cap, base e
        engine = dict(block=triton_decode.WIDE_BLOCK_N, num_warps=4, num_stages=3, maxnreg=0, exp2=False, r_pad=16)
    names = {"blocks": "block", "warps": "num_warps", "stages": "num_stages", "maxnreg": "maxnreg", "exp2": "exp2",
             "r_pad": "r_pad"}  # fmt: skip
    for option, key in names.items():  # those not given: the engine's (recorded in the report)
        if getattr(args, option) is None:
            setattr(args, option, [int(engine[key])])
    report = {"target": "sm_90", "args": vars(args), "settings": []}
    head = "kv    block warps stages maxnreg exp2 warp_slots shared groups r_pad bits | regs stack shared programs/SM"
    head += " (by regs, shared)"
    print(head + " | loop: " + " ".join(KINDS), flush=True)
    settings = itertools.product(
        args.blocks, args.warps, args.stages, args.maxnreg, args.exp2, args.warp_slots, args.shared, args.groups,
        args.r_pad, args.bits_cvt,
    )  # fmt: skip
    for block, warps, stage, cap, exp2, own, shared, groups, r_pad, bits in settings:
        if own and (block % warps or block // warps < 16):  # decode_attention refuses it
            continue
        row = compile_one(
            args.kv, block, warps, stage, cap, bool(exp2), bool(own), bool(shared), bool(groups), r_pad,
            bool(bits) and fp8,
        )  # fmt: skip
        row.update(
            kv=args.kv, block=block, warps=warps, stages=stage, maxnreg=cap, exp2=bool(exp2), warp_slots=bool(own),
            shared=bool(shared or groups), groups=bool(groups), bits_cvt=bool(bits) and fp8,
        )  # fmt: skip
        report["settings"].append(row)
        print(
            f"{args.kv:5s} {block:5d} {warps:5d} {stage:6d} {cap:7d} {exp2:4d} {own:10d} {shared:6d} {groups:6d} "
            f"{row['r_pad']:5d} {int(row['bits_cvt']):4d} | "
            f"{row['registers']:4d} "
            f"{row['stack_bytes']:5d} {row['shared_bytes']:6d} {row['programs']:3d} ({row['registers_limit']}, "
            f"{row['shared_limit']}) | {row['loop_instructions']}: " + " ".join(str(row["loop"][k]) for k in KINDS),
            flush=True,
        )
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
