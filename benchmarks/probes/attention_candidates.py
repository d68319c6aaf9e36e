"""Probe (issue 17, twenty-ninth session): the FP8 cache attention's candidate settings, timed in one go on a GPU.

The twenty-ninth session read the FP8 cache's decode attention in its compiled sm_90 code (attention_code.py, no GPU)
and left switches in triton_decode to be timed: EXP2, FP8_MAXNREG, FP8_WARP_SLOTS, with FP8_WARPS, FP8_BLOCK_N and
FP8_STAGES (docs/PERF.md); the thirty-first session timed them and made each batch size's best the engine's
(triton_decode.fp8_launch). This runs
1. the kernel alone: each candidate of CANDIDATES as a form of fp8_cache_layout.py (--ragged: a generate call's
   spread of positions; values in the engine's chunks), at each batch size: us a layer, and how far its output lies
   from float32 attention over the dequantized cache at most (the probe's rows form with the same settings against
   float32, plus the chunked form's difference to it);
2. the engine (generate_repeats.py with FP8 weights and cache): its own settings, the plain candidate's (the
   settings before the thirty-first session) and the --top fastest other candidates' (by the kernel's time at the
   largest batch size), each in a process of its own with its constants set by --set;
3. with --groups N (thirtieth session): the engine on GRPO-shaped calls (--group-batch rows, each prompt in N
   neighbouring rows): every row prefilled, the prompt prefilled once with each row reading its own copy
   (triton_decode.SHARED_PREFIX off), once with the group's prompt read from its first row (GROUP_PREFIX off), that
   with the prompt attended once for a chunk of a group's rows (triton_decode.GROUP_PREFIX, here at every batch
   size), and the engine's default with the plain candidate's settings;
then prints the tables. --tiny: the CPU's smoke run (Triton's interpreter; the engine with its CPU settings).

    python3 benchmarks/probes/attention_candidates.py --out result.json
    python3 benchmarks/probes/attention_candidates.py --batch-sizes 256 --top 3 --repeats 5
    python3 benchmarks/probes/attention_candidates.py --batch-sizes 64 256 --top 2 --groups 8 --out result.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes import fp8_cache_layout  # noqa: E402
from benchmarks.probes.common import write_report  # noqa: E402
from benchmarks.probes.generate_repeats import medians  # noqa: E402

# name: (slots a step, warps, pipeline stages, register cap (0: none), softmax in base 2, each warp its own slots,
# query rows a product holds); plain: the engine's settings at every batch size before the thirty-first session; the
# candidates with 16 query rows as timed then (thirty-first session), those with 4 since FP8_R_PAD (thirty-sixth)
CANDIDATES = {
    "plain": (128, 4, 2, 0, 0, 0, 16),
    "cap128": (128, 4, 2, 128, 0, 0, 16),
    "exp2_cap168": (128, 4, 2, 168, 1, 0, 16),
    "exp2_cap128": (128, 4, 2, 128, 1, 0, 16),
    "own_exp2": (128, 4, 2, 0, 1, 1, 16),
    "own_exp2_cap168": (128, 4, 2, 168, 1, 1, 16),
    "own_exp2_cap168_s3": (128, 4, 3, 168, 1, 1, 16),
    "w2_b64_exp2_cap128": (64, 2, 2, 128, 1, 0, 16),
    "w2_b64_own_exp2_cap168": (64, 2, 2, 168, 1, 1, 16),
    # the engine's forms since the thirty-sixth session (below / from 128 rows), and one warp a program: no exchange
    # between warps in the loop (in the sm_90 code 675 loop instructions for 32 slots, the 2-warp form's count a warp;
    # 214 registers uncapped: 9 programs an SM; 168: 12, no spill in the loop). Uncapped in the engine on an H100:
    # -0.5 to -0.8 % at 128-256 rows without groups, +0.9 to +1.5 % GRPO-shaped (docs/PERF.md, thirty-sixth session)
    "exp2_cap128_q4": (128, 4, 2, 128, 1, 0, 4),
    "w2_b64_exp2_cap128_q4": (64, 2, 2, 128, 1, 0, 4),
    "w1_b32_exp2_q4": (32, 1, 2, 0, 1, 0, 4),
    "w1_b32_exp2_cap168_q4": (32, 1, 2, 168, 1, 0, 4),
}
REPEATS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generate_repeats.py")


def settings(candidate: tuple) -> list[str]:
    """The candidate as generate_repeats.py's --set items (the engine's triton_decode constants)."""
    block, warps, stages, cap, exp2, own, r_pad = candidate
    return [
        f"triton_decode.FP8_BLOCK_N={block}", f"triton_decode.FP8_WARPS={warps}", f"triton_decode.FP8_STAGES={stages}",
        f"triton_decode.FP8_MAXNREG={cap}", f"triton_decode.EXP2={bool(exp2)}",
        f"triton_decode.FP8_WARP_SLOTS={bool(own)}", f"triton_decode.FP8_R_PAD={r_pad}",
    ]  # fmt: skip


def kernel_alone(name: str, candidate: tuple, args) -> dict:
    """Stage 1 for one candidate: {batch size: {"us": us a layer, "vs_float32": a bound on its distance to float32
    attention}}."""
    block, warps, stages, cap, exp2, own, r_pad = candidate
    chunk = 16 if args.tiny else 64
    argv = ["--ragged", "--batch-sizes", *map(str, args.batch_sizes), "--chunks", str(chunk), "--blocks", str(block)]
    argv += ["--warps", str(warps), "--stages", str(stages), "--maxnreg", str(cap), "--exp2", str(exp2)]
    argv += ["--warp-slots", str(own), "--r-pad", str(r_pad)] + (["--tiny"] if args.tiny else [])
    print(f"== {name}: kernel alone", flush=True)
    report = fp8_cache_layout.main(argv)
    out = {}
    for B, row in report["batches"].items():
        form = next((n for n in row["us"] if n.startswith(f"fp8_chunk{chunk}_")), None)
        if form is not None:  # absent: this GPU could not build it (reported above)
            out[B] = {"us": row["us"][form], "vs_float32": row["rows_vs_float32"] + row["max_diff_to_rows"][form]}
    return out


# stage 3's forms: (generate_repeats.py options, --set items)
GROUP_FORMS = {
    "each_row": (["--prefill-each-row"], []),
    "once": ([], ["triton_decode.SHARED_PREFIX=False"]),
    "once_shared": ([], ["triton_decode.GROUP_PREFIX=False"]),
    "once_groups": ([], ["triton_decode.GROUP_PREFIX=True", "triton_decode.GROUP_PREFIX_MIN_BATCH=2"]),
    "once_plain": ([], settings(CANDIDATES["plain"])),
}


def engine(name: str, items: list[str], args, batch_sizes=None, options=()) -> dict:
    """Stages 2 and 3 for one setting: generate_repeats.py's report, in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        sizes = batch_sizes or args.batch_sizes
        cmd = [sys.executable, REPEATS, "--repeats", str(args.repeats), "--batch-sizes", *map(str, sizes), *options]
        cmd += ["--tiny"] if args.tiny else ["--decode-weights", "fp8", "--kv-dtype", "fp8"]
        cmd += ["--out", out] + (["--set", *items] if items else [])
        print(f"== {name}: engine", flush=True)
        run = subprocess.run(cmd)
        if run.returncode:
            return {"failed": run.returncode}
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=list(CANDIDATES))
    parser.add_argument("--top", type=int, default=2, help="candidates timed in the engine besides its own settings")
    parser.add_argument("--repeats", type=int, default=5, help="generate calls per batch size in the engine")
    parser.add_argument("--groups", type=int, default=0, help="stage 3: samples a prompt (0: no stage 3)")
    parser.add_argument("--group-batch", type=int, default=512, help="stage 3's rows a call")
    parser.add_argument("--tiny", action="store_true", help="CPU: the smoke forms of every stage")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    report = {"args": vars(args), "kernel": {}, "engine": {}}
    for name in args.candidates:
        report["kernel"][name] = kernel_alone(name, CANDIDATES[name], args)
    largest = str(max(args.batch_sizes))
    timed = [n for n in args.candidates if n != "plain" and largest in report["kernel"][n]]
    best = sorted(timed, key=lambda n: report["kernel"][n][largest]["us"])[: args.top]
    report["engine"]["engine"] = engine("engine", [], args)
    for name in (["plain"] if "plain" in args.candidates else []) + best:
        report["engine"][name] = engine(name, settings(CANDIDATES[name]), args)
    print(
        "candidate                  "
        + "".join(f"| B={B}: kernel us, vs float32, decode ms, tok/s " for B in args.batch_sizes)
    )
    for name in ["engine", *args.candidates]:  # the engine's own settings (by batch size): timed in the engine only
        line = f"{name:26s} "
        for B in map(str, args.batch_sizes):
            k = report["kernel"].get(name, {}).get(B)
            e = report["engine"].get(name, {}).get(B)
            blank = "| " + " " * 18 if name == "engine" else "|   failed          "
            line += f"| {k['us']:8.2f} {k['vs_float32']:8.2g} " if k else blank
            line += f"{medians(e)['decode_ms']:8.4f} {medians(e)['tok_s']:8.0f} " if e else " " * 18
        print(line, flush=True)
    if args.groups:
        report["groups"] = {}
        options = ["--samples-per-prompt", str(args.groups)]
        for name, (extra, items) in GROUP_FORMS.items():
            report["groups"][name] = engine(name, items, args, [args.group_batch], [*options, *extra])
        print(f"B={args.group_batch}, {args.groups} samples a prompt | prompts prefilled, prefill ms, decode ms, tok/s")
        for name, run in report["groups"].items():
            e = run.get(str(args.group_batch))
            if e is None:
                print(f"{name:26s} | failed", flush=True)
                continue
            med = medians(e)
            line = f"{med['prefill_ms']:8.2f} {med['decode_ms']:8.4f} {med['tok_s']:8.0f}"
            print(f"{name:26s} | {e['prefill_prompts']:5d} {line}", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
