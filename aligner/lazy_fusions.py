"""megatron-core's fused elementwise functions compiled on their first call, not when megatron is imported.

megatron-core decorates its fusions (bias+GeLU, bias+SwiGLU, ...) with `megatron.core.jit.jit_fuser`, which is
`torch.compile` on torch >= 2.2. Used as a decorator at import, torch.compile imports dynamo and inductor's compiler
(`torch._inductor.compile_fx` and what it pulls in): about 2-4 s of CPU in every process that imports megatron,
whether or not it ever calls a fusion (on the CPU none is called: aligner turns megatron's fusions off there; on a
GPU the trained models call bias+SwiGLU and bias-dropout-add; the conversion scripts never do). `install()` (called
by `aligner/__init__.py`, before anything imports megatron) puts an import hook on `megatron.core.jit` only: once
that module has run, its `jit_fuser` becomes `compile_on_first_call`, which calls torch.compile with the same
arguments on a function's first call. torch.compile compiles on the first call anyway, so what runs, and when it is
compiled, are as before; only the import is cheaper.

The hook touches nothing else and imports nothing (no torch) until megatron.core.jit is imported.
`megatron.core.jit.disable_jit_fuser()` still turns the fusions off for what is decorated after it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

MODULE = "megatron.core.jit"


def compile_on_first_call(fn=None, **compile_kw):
    """torch.compile(fn, **compile_kw), made on fn's first call (usable as @decorator and @decorator(**kw))."""
    if fn is None:
        return lambda f: compile_on_first_call(f, **compile_kw)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **compile_kw)
        return compiled(*args, **kwargs)

    call.compile_on_first_call = True
    return call


class _JitLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        import torch

        if module.jit_fuser is torch.compile:  # (torch.jit.script or a no-op where torch.compile is not the fuser)
            module.jit_fuser = compile_on_first_call


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _JitLoader(spec.loader)
        return spec


def install() -> None:
    """Idempotent; does nothing once megatron.core.jit is imported (its fusions are decorated already)."""
    if MODULE in sys.modules or any(isinstance(f, _JitFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _JitFinder())
