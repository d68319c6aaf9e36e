"""aligner's Triton kernels (the engine's, the training models' RoPE) compiled for the H200 (sm_90) and an A100
(sm_80) here, without a GPU (tests/triton_sm90.py): the interpreter the other tests run them under checks no types,
Triton's compiler does."""

import ast
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "triton_sm90.py")
KERNELS = [
    "decode_attention_fwd", "decode_attention_merge", "splitk_gemm", "gated_gemm", "splitk_fp8_gemm",
    "gated_fp8_gemm", "quantize_rows_k",
    "add_norm_rows", "choice_parts", "choice_merge", "prefill_fp8_write", "rope_rows",
]  # fmt: skip


def _run(*args, **env):
    return subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=600, env={**os.environ, **env}
    )


def test_every_recorded_kernel_compiles_for_sm90(tmp_path):
    from dist import free_port

    specs = str(tmp_path / "specs.json")
    recorded = _run("record", specs, MASTER_PORT=str(free_port()))
    assert recorded.returncode == 0, recorded.stdout[-2000:] + recorded.stderr[-4000:]
    compiled = _run("compile", specs)
    assert compiled.returncode == 0, compiled.stdout[-6000:] + compiled.stderr[-2000:]
    lines = compiled.stdout.splitlines()
    ok = [line.split()[1:3] for line in lines if line.startswith("OK ")]
    # each of the engine's kernels, in every specialization the CPU run took; for an A100 those without FP8
    assert {name for target, name in ok if target == "sm_90"} == set(KERNELS), ok
    fp8_only = {"splitk_fp8_gemm", "gated_fp8_gemm", "prefill_fp8_write"}
    assert {name for target, name in ok if target == "sm_80"} == set(KERNELS) - fp8_only
    # FP8 cache with the kernel's own write, with and without RoPE (where a type change once broke the GPU build),
    # its values in the engine's chunks
    assert compiled.stdout.count("'WRITE_NEW': True") >= 4 and "'KV_FP8': True" in compiled.stdout
    assert "'V_CHUNK': 64" in compiled.stdout
    # a group's prompt by group programs (GROUP_PREFIX: the start-up check's call) and the merge after them
    assert "'GROUPS': True" in compiled.stdout and "'SPLITS': 2" in compiled.stdout
    # Qwen3's q/k norms applied by the kernel before its RoPE, with the bf16 and the FP8 cache
    assert sum("OK   sm_90 decode_attention_fwd" in line and "'QK_NORM': True" in line for line in lines) == 2
    # and what steps above 128 rows take: FP8 fc1 and qkv in row blocks, 64 attention slots a step
    assert compiled.stdout.count("'BLOCK_M': 128") == 2 and "'BLOCK': 64," in compiled.stdout
    # the RoPE kernel's forward and backward, with and without channels past the rotary part, on both GPUs
    rope = [line for line in compiled.stdout.splitlines() if line.startswith("OK ") and " rope_rows " in line]
    assert len(rope) == 8 and sum("'BACKWARD': True" in line and "'REST': 32" in line for line in rope) == 2
    # compiled with the alignment the JIT sees on the GPU (pointers and sizes divisible by 16): the pipelined forms,
    # whose shared memory is num_stages x splitk.stage_bytes (without the hints Triton builds unpipelined loops)
    from aligner.generation.native import splitk

    blocks = [line for line in lines if line.startswith("OK   sm_90") and "'BLOCK_M': 128" in line]
    assert len(blocks) == 2
    for line in blocks:
        constexprs, options = (ast.literal_eval(part) for part in re.findall(r"\{[^}]*\}", line))
        tiling = splitk.Tiling(constexprs["BLOCK_N"], constexprs["BLOCK_K"], 1, 8, options["num_stages"], block_m=128)
        one_stage = splitk.stage_bytes(tiling, 256, 1, gated=" gated_fp8_gemm " in line)
        assert int(line.rsplit("shared ", 1)[1].split()[0]) == options["num_stages"] * one_stage, line
    assert "1 of them hold more than 99 KiB" in compiled.stdout  # the five-stage row blocks (one_wave fits them)
