"""Process-group helpers shared by the RL maths (private).

Convention: `group=None` means "no reduction" (local statistics), not torch's default WORLD group, so a pure
function never starts a collective by accident. Pass the data-parallel group explicitly to reduce over it
(`torch.distributed.group.WORLD` for every rank). Every rank of a group must make the same calls in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def reduction_active(group) -> bool:
    """True when `group` names a process group of more than one rank in an initialised job."""
    return group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce_(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce `tensor` in place over `group` (no-op when `reduction_active(group)` is false); returns it."""
    if reduction_active(group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def collective_device(group, values=()) -> torch.device:
    """Where a tensor for a collective over `group` must live: the bound GPU under NCCL (which has no CPU transport:
    statistics gathered as floats or CPU tensors must move there; seen failing on 2x H200), else the device of the
    first tensor in `values`, else the CPU."""
    if reduction_active(group) and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    for v in values:
        if isinstance(v, torch.Tensor):
            return v.device
    return torch.device("cpu")
