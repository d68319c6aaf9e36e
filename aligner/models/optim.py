"""The optimizer of a trainable model, chosen once at construction: megatron's on GPU, torch's AdamW on CPU.

Contract (`ModelOptimizer`, what TrainableModel and the checkpoints see):
- `param_groups`: the inner optimizer's groups (the trainer sets `lr` in them before each step).
- `zero_grad()`; `step() -> grad_norm`: clip the gradients to `clip_grad` by their global norm (over TP x PP, every
  parameter counted once; over DP the gradients are already summed) and take one Adam step. The caller has checked
  that the gradients are finite (TrainableModel skips the step otherwise).
- `reload_model_params()`: the model's weights were overwritten from elsewhere (a checkpoint): refresh any copy.
- `save(directory, model_sharded_state)` / `load(directory, model_sharded_state)`: the optimizer's part of a
  checkpoint, written and read by every rank (collective on GPU). Nothing in it is pickled code: the CPU files load
  with `torch.load(weights_only=True)`.

Backends:
- `MegatronOptimizer` (GPU): megatron-core's (distributed) optimizer with fp32 main parameters; checkpoints in
  megatron's dist-checkpoint format with the 'dp_reshardable' layout (resumes on any DP size with the same TP/PP;
  megatron-core 0.16.1's default layout is rejected by its own dist checkpointing: seen on the H200). Without
  apex/TE megatron steps with torch's Adam, whose default multi-tensor form allocates a temporary as large as the
  second moment (4 bytes a parameter: 12 GB at 3B); `optim.fused_adam: auto` has it take torch's fused kernel
  instead (one pass, no temporary; SmolLM3-3B's GRPO step peaked 3.9 GB lower on an H100, docs/PERF.md), set again
  after every checkpoint load.
- `TorchOptimizer` (CPU, where megatron's optimizer wrappers refuse CPU tensors): torch's AdamW with the same
  settings and the same clipping; one file per rank, so it resumes only on the layout that saved it.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist

from aligner.config.schema import OptimConfig
from aligner.parallel.device import on_gpu

OPTIM_SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


class ModelOptimizer(Protocol):
    param_groups: list

    def zero_grad(self) -> None: ...

    def step(self) -> float: ...

    def reload_model_params(self) -> None: ...

    def save(self, directory: str, model_sharded_state: dict) -> None: ...

    def load(self, directory: str, model_sharded_state: dict) -> None: ...


class MegatronOptimizer:
    def __init__(self, model_chunks: list, model_config, cfg: OptimConfig):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ocfg = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=model_config.bf16,
            fp16=model_config.fp16,
            params_dtype=model_config.params_dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        )
        # aligner makes no gloo groups on GPU (initialize: NCCL only), so the optimizer must not ask for them.
        self.inner = get_megatron_optimizer(ocfg, model_chunks, use_gloo_process_groups=False)
        self.fused = cfg.fused_adam == "auto"
        if self.fused:
            fuse_torch_adam(self.inner)
        for opt in getattr(self.inner, "chained_optimizers", [self.inner]):
            if hasattr(opt, "model_param_group_index_map") and hasattr(opt, "model_fp32_groups"):
                opt.model_param_group_index_map = group_index_map(opt.model_fp32_groups, opt.model_float16_groups)
                _check_group_index_map(opt)

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> float:
        _, grad_norm, _ = self.inner.step()
        return float(grad_norm if grad_norm is not None else 0.0)

    def reload_model_params(self) -> None:
        self.inner.reload_model_params()

    def save(self, directory: str, model_sharded_state: dict) -> None:
        from megatron.core import dist_checkpointing

        dist_checkpointing.save(self.inner.sharded_state_dict(model_sharded_state, metadata=OPTIM_SHARDING), directory)

    @torch.no_grad()  # megatron copies the loaded state into views of leaf parameters
    def load(self, directory: str, model_sharded_state: dict) -> None:
        from megatron.core import dist_checkpointing

        inner_optimizers = getattr(self.inner, "chained_optimizers", [self.inner])
        # A fresh torch Adam has no state (not even 'step'), and megatron's distributed optimizer cannot describe an
        # empty state without apex/TE (it asserts on the step): give it zero-valued states first, as megatron does
        # for its own fsdp format. The load overwrites them.
        for opt in inner_optimizers:
            init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
            if callable(init) and not opt.optimizer.state:
                init()
        sharded = self.inner.sharded_state_dict(model_sharded_state, is_loading=True, metadata=OPTIM_SHARDING)
        self.inner.load_state_dict(dist_checkpointing.load(sharded, directory))
        # megatron-core 0.16.1 (without apex/TE) hands every parameter's Adam state the *same* 'step' tensor; torch
        # then increments it once per parameter in each step, so bias correction after a resume used step ~ 1 + the
        # number of parameters instead of 2 (weights 7.3e-4 off after one resumed step on the H200;
        # tests/gpu/probe_resume.py). Give each parameter its own counter.
        for opt in inner_optimizers:
            for state in opt.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        if self.fused:  # a load brings back the saved groups' flags and CPU step counters
            fuse_torch_adam(self.inner)


def fuse_torch_adam(optimizer) -> int:
    """Switch each torch Adam/AdamW inside megatron's `optimizer` whose parameters all lie on a GPU in a floating
    dtype to torch's fused kernel (its 'step' counters moved to their parameters' devices, as the kernel reads
    them); returns how many groups were switched. apex's and TE's own fused Adams are left as they are."""
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        for group in inner.param_groups:
            params = [p for p in group["params"] if p is not None]
            if not params or not all(p.is_cuda and p.is_floating_point() for p in params):
                continue
            group["fused"], group["foreach"] = True, False
            switched += 1
            for p in params:
                state = inner.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return switched


def group_index_map(fp32_groups: list[list], float16_groups: list[list]) -> dict:
    """{model parameter: (group index, position in the inner optimizer's group)} for megatron's distributed
    optimizer, whose inner groups hold the fp32 parameters' shards first, then the main (fp32) copies of the
    float16/bf16 ones.

    megatron-core 0.16.1 numbers the parameters in gradient-buffer order instead, which is the same only while a
    group holds one dtype. The critic's groups do not: without apex/TE megatron's norms are fp32 parameters in a bf16
    model, and the value head's bias joins them in the no-weight-decay group; its checkpoint then paired the bias
    with a norm's optimizer state (`critic_save` failed on the H200 with `AssertionError: (torch.Size([64]), 0, 1)`;
    a load would have put the states in the wrong places). The checkpoint maps use this numbering; the step itself
    never did."""
    order = {}
    for g, (fp32, low) in enumerate(zip(fp32_groups, float16_groups)):
        for i, param in enumerate([*fp32, *low]):
            order[param] = (g, i)
    return order


def _check_group_index_map(opt) -> None:
    """Every parameter's entry names an inner parameter of its shard's size (else checkpoints would mix states)."""
    for param, (g, i) in opt.model_param_group_index_map.items():
        shard = opt._get_model_param_range_map(param)["param"]
        inner = opt.optimizer.param_groups[g]["params"][i]
        if inner is not None and inner.numel() != shard.size:
            raise RuntimeError(
                f"megatron's optimizer maps a parameter of {shard.size} elements to a state of {inner.numel()}: "
                "this megatron-core version orders its groups differently from what aligner expects"
            )


class TorchOptimizer:
    def __init__(self, model_chunks: list, cfg: OptimConfig):
        self.cfg = cfg
        self.params = [p for m in model_chunks for p in m.parameters() if p.requires_grad]
        self.inner = torch.optim.AdamW(
            self.params,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
        )

    @property
    def param_groups(self) -> list:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> float:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        for p in self.params:  # megatron's DDP accumulates into main_grad
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
        sq = torch.zeros((), dtype=torch.float64)
        for p in self.params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = float(sq.sqrt())
        clip = self.cfg.clip_grad
        if clip and clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.inner.step()
        return norm

    def reload_model_params(self) -> None:
        pass  # the optimizer updates the model's own parameters: there is no copy to refresh

    @staticmethod
    def _file(directory: str) -> str:
        from megatron.core import parallel_state as ps

        name = (
            f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}"
            f"_dp{ps.get_data_parallel_rank()}.pt"
        )
        return os.path.join(directory, name)

    @staticmethod
    def _layout() -> list[int]:
        from megatron.core import parallel_state as ps

        return [
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_data_parallel_world_size(),
        ]

    def save(self, directory: str, model_sharded_state: dict) -> None:
        torch.save({"optimizer": self.inner.state_dict(), "layout": self._layout()}, self._file(directory))

    def load(self, directory: str, model_sharded_state: dict) -> None:
        file = self._file(directory)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{file} missing: CPU optimizer state resumes only on the layout that saved it")
        self.inner.load_state_dict(torch.load(file, weights_only=True)["optimizer"])


def build_optimizer(model_chunks: list, model_config, cfg: OptimConfig) -> ModelOptimizer:
    """The backend for this process, chosen once (see the module docstring)."""
    if on_gpu():
        return MegatronOptimizer(model_chunks, model_config, cfg)
    return TorchOptimizer(model_chunks, cfg)
