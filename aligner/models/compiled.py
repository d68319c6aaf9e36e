"""torch.compile for aligner's optional fused kernels (`model.rope_fusion`, `model.logprob_fusion`).

A function is compiled on its first call. Where compiling fails (no working C compiler for Triton or inductor, a
GPU this Triton does not support, a torch.compile bug) the plain function runs instead, from then on, after one
warning that names the setting and the error: the fused kernels are accelerators (same maths, fewer passes over
memory), never a reason for a job to stop. Out-of-memory is not a compile failure and is raised as it is; an error
of the function itself is raised by its eager run.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


class CompiledOrEager:
    def __init__(self, fn: Callable, setting: str, **compile_kw):
        self.fn, self.setting, self.compile_kw = fn, setting, compile_kw
        self._compiled: Callable | None = None
        self.failure: str | None = None  # the compile error, once it happened

    def __call__(self, *args):
        if self.failure is None:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, **self.compile_kw)
            try:
                return self._compiled(*args)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - any compile failure: run the same maths eagerly
                first = str(exc).strip().splitlines()
                self.failure = f"{type(exc).__name__}: {first[0] if first else ''}"[:300]
                log.warning(
                    "%s: compiling %s failed (%s); it runs eagerly from now on (same results, slower). Set %s: off "
                    "to skip the attempt.",
                    self.setting,
                    self.fn.__name__,
                    self.failure,
                    self.setting,
                )
        return self.fn(*args)
