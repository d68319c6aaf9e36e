"""Where this process computes, decided once: the GPU that `initialize` bound, else the CPU.

Every module asks here instead of testing `torch.cuda.is_available()` itself, so "GPU or CPU" is one fact with one
home (the CPU path is the development and CI path; see cpu_compat.py).
"""

from __future__ import annotations

import functools
import os

import torch


def on_gpu() -> bool:
    return torch.cuda.is_available()


def current_device() -> torch.device:
    """The device this rank's tensors live on."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


@functools.cache
def triton_available() -> bool:
    """Whether Triton (torch.compile's GPU backend) imports here: the optional compiled kernels ask this (the log-probs
    on every call: answered once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_kernels_unavailable(device: torch.device) -> str | None:
    """Why our own Triton kernels cannot run on `device` (None if they can): Triton installed, and a CUDA device of
    compute capability 8.0 or newer (bf16 and TF32 tensor cores), or on the CPU Triton's interpreter
    (TRITON_INTERPRET=1, as the tests run them). Each kernel adds its own tiny start-up call on top."""
    if not triton_available():
        return "Triton is not installed"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            return f"it needs compute capability 8.0 or newer, this GPU has {major}.{minor}"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        return "it needs a CUDA device (or Triton's interpreter, TRITON_INTERPRET=1, for tests)"
    return None


def synchronize() -> None:
    """Wait for queued device work (a no-op on the CPU); timers call it so that a phase's time is its own."""
    if on_gpu():
        torch.cuda.synchronize()
