"""Run the real megatron-core on a CPU-only PyTorch, with gloo standing in for NCCL.

Contract: `install()` is called once per process, before any megatron-core model is built; it does nothing when
CUDA is available, so GPU runs never see it. It is idempotent. After it:
- tensor factories that name a CUDA device (`device="cuda"`, `device=torch.cuda.current_device()`) make CPU tensors,
  and `pin_memory=True` is dropped (megatron's pipeline schedules and optimizers create such tensors literally);
- `torch.cuda.current_device()` answers 0 and `torch.cuda.synchronize()` is a no-op;
- megatron's CUDA RNG tracker is replaced by `CpuRngStatesTracker`, which forks named CPU generator states, so
  `model_parallel_cuda_manual_seed` and dropout inside tensor-parallel regions work;
- megatron's activation recomputation (`model.recompute`) skips the CUDA generator's state (there is none);
- `Tensor.type()` of a CPU float tensor still reads 'torch.FloatTensor': megatron's own optimizer wrappers refuse it,
  so on CPU the trainers use plain torch optimizers with the same semantics (see aligner/models/optim.py).

Seen working with megatron-core 0.16.1 and torch 2.13 CPU: GPTModel forward/backward at TP=2, the PP=2 pipeline
schedule, megatron's DistributedDataParallel gradient all-reduce, dist checkpointing (torch_dist) over gloo, and
selective and full activation recomputation (tests/unit/test_recompute.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from aligner.parallel.device import on_gpu

_INSTALLED = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # megatron passes torch.cuda.current_device(), an index
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaFactoriesToCpu(TorchFunctionMode):
    """Rewrites `device=<cuda>` to the CPU and drops `pin_memory` in every torch call made under it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.to and args and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.autograd.backward:
            return _backward_under_mode(*args, **kwargs)
        if func is torch.Tensor.backward:
            return _backward_under_mode(args[0], *args[1:], **kwargs)
        return func(*args, **kwargs)


def _backward_under_mode(tensors, grad_tensors=None, retain_graph=None, create_graph=False, inputs=None, **kw):
    """torch.autograd.backward with the CPU mode on while the engine runs the backward functions (megatron's
    sequence-parallel linears allocate on `torch.cuda.current_device()` there). A mode is off while its own handler
    runs, and calling `backward` again would only come back to the handler: so this is backward's own body after
    its dispatch check (torch 2.13: `_make_grads`, then `_engine_run_backward`)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    grad_tensors = kw.pop("gradient", grad_tensors)  # Tensor.backward's name for it
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = () if inputs is None else ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs))
    grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False)
    with _CudaFactoriesToCpu():
        _engine_run_backward(
            tensors,
            grads,
            create_graph if retain_graph is None else retain_graph,
            create_graph,
            inputs,
            allow_unreachable=True,
            accumulate_grad=True,
        )


class CpuRngStatesTracker:
    """CPU stand-in for megatron's `CudaRNGStatesTracker`: named generator states forked around random ops."""

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return True

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} already exists")
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.seeds_.add(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} was never added (call aligner.parallel.set_seed first)")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def install() -> bool:
    """Make megatron-core usable on this CPU-only process. Returns True when the layer is active."""
    global _INSTALLED
    if on_gpu():
        return False
    if _INSTALLED:
        return True
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.empty_cache = lambda: None

    import megatron.core.tensor_parallel.random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRngStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Activation recomputation saves and restores the CUDA generator's state around each recomputed chunk: there is
    # none here (the CPU generator and the tracker's named states are saved beside it).
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    # Entered for the life of the process: megatron creates CUDA tensors at arbitrary points of its schedules.
    _CudaFactoriesToCpu().__enter__()
    _INSTALLED = True
    return True
