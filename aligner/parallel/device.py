"""Where this process computes, decided once: the GPU that `initialize` bound, else the CPU.

Every module asks here instead of testing `torch.cuda.is_available()` itself, so "GPU or CPU" is one fact with one
home (the CPU path is the development and CI path; see cpu_compat.py).
"""

from __future__ import annotations

import functools

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


def synchronize() -> None:
    """Wait for queued device work (a no-op on the CPU); timers call it so that a phase's time is its own."""
    if on_gpu():
        torch.cuda.synchronize()
