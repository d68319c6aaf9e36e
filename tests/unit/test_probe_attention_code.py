"""benchmarks/probes/attention_code.py on the CPU: the decode attention kernel compiled for sm_90 (Triton's own ptxas,
cuobjdump and nvdisasm; no GPU) and its resources read back. What the twenty-ninth session found with it must hold
for the probe to be believed: a register cap of 128 leaves the FP8 kernel's slot loop without spills and fits 4
programs an SM where the uncapped kernel fits fewer, the base-2 softmax takes products out of the loop, and with each
warp its own slots the loop exchanges nothing between warps and is shorter. The engine's settings chosen from the
thirty-first session's timings must compile as described (triton_decode.fp8_launch: 4 and 8 programs an SM)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

from benchmarks.probes.attention_code import programs_per_sm  # noqa: E402


def _compiled(tmp_path, *args: str) -> list:
    """attention_code.py's settings rows for `args`, compiled in a process of its own (Triton's interpreter off)."""
    out = tmp_path / "r.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "probes", "attention_code.py"), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return json.load(open(out))["settings"]


def test_programs_per_sm_by_hand():
    # 168 registers: 5376 a warp (21 x 256), 21504 a program of 4 warps: 3 in 65536; 43008 + 1024 bytes: 5 in 228 KB
    assert programs_per_sm(168, 41984, 4) == {"registers_limit": 3, "shared_limit": 5, "warps_limit": 16, "programs": 3}
    # 101 registers round up to 104 (3328 a warp, 13 x 256): 4 programs; 8 warps of 128: 2
    assert programs_per_sm(101, 1024, 4)["programs"] == 4 and programs_per_sm(128, 1024, 8)["programs"] == 2


def test_the_fp8_kernel_compiled_for_sm90(tmp_path):
    settings = _compiled(  # (16 query rows, as then: FP8_R_PAD came in the thirty-sixth session)
        tmp_path, "--maxnreg", "0", "128", "168", "--exp2", "0", "1", "--warp-slots", "0", "1", "--r-pad", "16"
    )
    rows = {(r["maxnreg"], r["exp2"], r["warp_slots"]): r for r in settings}
    shared = {(cap, exp2): row for (cap, exp2, own), row in rows.items() if not own}
    for row in rows.values():
        assert row["block"] == 128 and row["stages"] == 2 and row["shared_bytes"] > 0  # the engine's FP8 settings
        assert row["loop"]["HMMA"] == 64 and row["loop"]["F2FP"] >= 128  # 2 products of 16 x 128 x 128 a step
    for exp2 in (False, True):
        capped, free = shared[(128, exp2)], shared[(0, exp2)]
        assert capped["registers"] <= 128 and capped["programs"] == 4 and free["programs"] < 4
        assert capped["loop"]["STL"] == capped["loop"]["LDL"] == 0  # no spill inside the slot loop
    assert shared[(128, True)]["loop"]["FMUL"] < shared[(128, False)]["loop"]["FMUL"]
    assert shared[(128, True)]["stack_bytes"] == 0
    # each warp its own slots: no probabilities through shared memory, fewer barriers and copies, fewer
    # instructions at the same register cap (168: 3 programs an SM, as the shared form uncapped)
    own, same = rows[(168, True, True)], shared[(168, True)]
    assert own["programs"] == same["programs"] == shared[(0, False)]["programs"] == 3
    assert own["loop"]["STS"] == 0 < same["loop"]["STS"] and own["loop"]["BAR"] < same["loop"]["BAR"]
    assert own["loop_instructions"] < 0.9 * same["loop_instructions"] and own["loop"]["MOV"] < same["loop"]["MOV"] / 4


def test_the_shared_prefix_form_keeps_the_kernels_occupancy_at_a_cap_of_168(tmp_path):
    """triton_decode.SHARED_PREFIX (a group's prompt steps read from its first row) adds a choice of row a step: at
    the register cap 168 the kernel keeps 3 programs an SM and no spill in its loop, a few percent more instructions
    (uncapped it takes more registers than the engine's kernel: timed on a GPU with the cap)."""
    settings = _compiled(tmp_path, "--maxnreg", "168", "--exp2", "0", "--shared", "0", "1", "--r-pad", "16")
    plain, shared = sorted(settings, key=lambda r: r["shared"])
    assert shared["shared"] and shared["programs"] == plain["programs"] == 3
    assert shared["loop"]["STL"] == shared["loop"]["LDL"] == 0
    assert plain["loop_instructions"] < shared["loop_instructions"] < 1.06 * plain["loop_instructions"]


@pytest.mark.parametrize("rows, block, warps, programs", [(64, 128, 4, 4), (256, 64, 2, 8)])
def test_the_engines_fp8_launch_by_batch_size(tmp_path, rows, block, warps, programs):
    """The FP8 cache's launch the engine takes on the GPU (triton_decode.fp8_launch, timed on an H200): 128 slots in
    4 warps below 128 rows, 64 in 2 warps from there, both capped at 128 registers with the softmax in base 2: 4 and 8
    programs an SM, nothing spilled inside the slot loop."""
    (row,) = _compiled(tmp_path, "--rows", str(rows))
    assert (row["block"], row["warps"], row["stages"], row["maxnreg"], row["exp2"]) == (block, warps, 2, 128, True)
    assert row["registers"] <= 128 and row["programs"] == programs
    assert row["loop"]["STL"] == row["loop"]["LDL"] == 0 and row["loop"]["HMMA"] == 64


def test_the_group_programs_form_at_512_rows(tmp_path):
    """triton_decode.GROUP_PREFIX's kernel (group programs beside the rows', 16 query rows a program; the engine's
    form from 512 rows in the thirty-fifth session, off since): at the engine's launch for 512 rows still 8 programs
    an SM, no more than two spilled loads in the slot loop (as the shared prefix's form at 16 rows), at most 10 % more
    loop instructions than that form (the query rows gathered by row)."""
    settings = _compiled(tmp_path, "--rows", "512", "--shared", "1", "--groups", "0", "1", "--r-pad", "16")
    shared, groups = sorted(settings, key=lambda r: r["groups"])
    assert groups["groups"] and not shared["groups"] and groups["programs"] == shared["programs"] == 8
    assert groups["loop"]["STL"] == 0 and groups["loop"]["LDL"] <= 2
    assert shared["loop_instructions"] < groups["loop_instructions"] < 1.1 * shared["loop_instructions"]


@pytest.mark.parametrize("rows, programs", [(64, 4), (256, 8)])
def test_fewer_padded_query_rows_shorten_the_fp8_slot_loop(tmp_path, rows, programs):
    """triton_decode.FP8_R_PAD: the 2 query heads of a group padded to 8 or 4 rows instead of a tensor-core product's
    16 (Triton pads the product itself): a thread holds half the scores and probabilities, so the slot loop has half
    the exponentials and at least 8 % fewer instructions, at the same products and occupancy, nothing spilled in the
    loop. The engine's default (no --r-pad) is FP8_R_PAD's 4."""
    from aligner.generation.native import triton_decode

    (engine,) = _compiled(tmp_path, "--rows", str(rows))
    assert engine["r_pad"] == triton_decode.FP8_R_PAD == 4
    by_pad = {r["r_pad"]: r for r in _compiled(tmp_path, "--rows", str(rows), "--r-pad", "16", "8")}
    by_pad[4] = engine
    assert all(row["programs"] == programs and row["loop"]["HMMA"] == 64 for row in by_pad.values())
    for fewer in (by_pad[8], by_pad[4]):
        assert fewer["loop"]["MUFU"] * 2 == by_pad[16]["loop"]["MUFU"]
        assert fewer["loop_instructions"] < 0.92 * by_pad[16]["loop_instructions"]
        assert fewer["loop"]["STL"] == fewer["loop"]["LDL"] == 0


def test_e4m3_by_bit_operations_in_the_slot_loop(tmp_path):
    """triton_decode.FP8_BITS_CVT (off: timed slower on an H100): the kernel with E4M3_BITS_ASM builds for sm_90 and
    its slot loop keeps no e4m3 conversion (F2FP: those left round the probabilities to float16), at the same products
    and occupancy, with more, plainer instructions in their place (+3.1 % a decode step at 256 rows)."""
    unit, bits = sorted(_compiled(tmp_path, "--rows", "256", "--bits-cvt", "0", "1"), key=lambda r: r["bits_cvt"])
    assert bits["bits_cvt"] and not unit["bits_cvt"]
    assert unit["loop"]["F2FP"] >= 128 and bits["loop"]["F2FP"] <= 8
    assert bits["programs"] == unit["programs"] == 8 and bits["loop"]["HMMA"] == unit["loop"]["HMMA"] == 64
    assert bits["loop_instructions"] > unit["loop_instructions"]
    assert bits["loop"]["STL"] == bits["loop"]["LDL"] == 0


def test_one_warp_a_program_exchanges_nothing_in_the_loop(tmp_path):
    """attention_candidates.py's one-warp candidates (thirty-sixth session; uncapped, timed in the engine): 32 slots a
    step in one warp with 4 query rows stores nothing to shared memory in the slot loop and waits only at the copy
    pipeline's barriers, with no more loop instructions than the engine's 2-warp form has a warp for 64 slots;
    uncapped 9 programs an SM, at a cap of 168 registers 12 without a spill in the loop."""
    engine = _compiled(tmp_path, "--rows", "256")[0]
    one = {r["maxnreg"]: r for r in _compiled(tmp_path, "--rows", "256", "--warps", "1", "--blocks", "32",
                                              "--maxnreg", "0", "168")}  # fmt: skip
    for row in one.values():
        assert row["loop"]["STS"] == 0 < engine["loop"]["STS"] and row["loop"]["BAR"] <= 2 < engine["loop"]["BAR"]
        assert row["loop"]["HMMA"] == 64 and row["loop"]["STL"] == row["loop"]["LDL"] == 0
    assert one[0]["loop_instructions"] <= engine["loop_instructions"]
    assert (one[0]["programs"], one[168]["programs"]) == (9, 12)
