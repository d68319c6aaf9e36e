"""Rank discovery, megatron process groups, the device of this process and the CPU compatibility layer
(see launch.py, device.py, cpu_compat.py)."""

from aligner.parallel.device import current_device, on_gpu, synchronize
from aligner.parallel.launch import (
    RankInfo,
    discover,
    host_barrier,
    host_broadcast,
    host_group,
    initialize,
    initialize_job,
    is_logging_rank,
    pick_backend,
    set_seed,
    shutdown,
)

__all__ = [
    "RankInfo",
    "current_device",
    "discover",
    "host_barrier",
    "host_broadcast",
    "host_group",
    "initialize",
    "initialize_job",
    "is_logging_rank",
    "on_gpu",
    "pick_backend",
    "set_seed",
    "shutdown",
    "synchronize",
]
