"""Programmatic dependent launch (PDL) for a decode step's kernels on Hopper and newer GPUs.

A decode step is a chain of ~120 short kernels, each reading what the one before wrote. Launched with PDL, a kernel's
programs may start while the kernel before it is still finishing; each first waits in `gdc_wait` until that kernel
has completed and its writes are visible, so the results are the same, and only the launch and the previous
kernel's tail overlap. Each of our kernels lets the next one launch (`gdc_launch_dependents`) once its main loop is
done, so always after its own wait (inductor's kernels too): when a kernel starts, every kernel two or more before it
has completed, and what those wrote may be read before the wait (the attention's positions, the norm's residual row:
triton_decode.py, rows.py). The compiled elementwise kernels of a decode step get the same from inductor (its
`triton.enable_pdl` option) where this PyTorch has it; cuBLAS's GEMMs take no part (the kernel after one starts when
it has finished, as without PDL).

Decode steps of up to MAX_BATCH rows take it: on the H200 it made steps of 64 rows 3.7-3.9 % faster (docs/PERF.md,
sixteenth session); with FP8 decode weights, steps of 256 and 512 rows 1.4 % and 1.0 % faster, with bf16 weights
0.3 % and 0.0 % (twenty-fifth session; the sixteenth had measured 1.2 % slower at 256 rows in bf16, with the step of
that day). Prefetching the start of each GEMM program's weight slab into L2 before the wait measured slower than
none (512 columns: +1 %, 2048: +19 % at 64 rows) and is not done.
`ENABLED` switches it for kernels built after the change (the engine decides when it builds).
"""

from __future__ import annotations

import torch

ENABLED = True
MAX_BATCH = 512  # decode steps of more rows launch as before (measured up to here: module docstring)


def wanted(device: torch.device | str, batch: int = 1) -> bool:
    """Whether a decode step of `batch` rows on `device` launches its kernels with PDL: up to MAX_BATCH rows, on a
    CUDA device of compute capability 9.0 or newer (Triton's interpreter and older GPUs have no grid dependency
    control)."""
    device = torch.device(device)
    if not ENABLED or batch > MAX_BATCH or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def inductor_options(device: torch.device | str) -> dict:
    """torch.compile options that give compiled decode kernels PDL on `device` ({} where not wanted or where this
    PyTorch's inductor has no such option); the caller uses them for steps of up to MAX_BATCH rows only."""
    if not wanted(device):
        return {}
    import torch._inductor.config as inductor_config

    return {"triton.enable_pdl": True} if hasattr(inductor_config.triton, "enable_pdl") else {}
