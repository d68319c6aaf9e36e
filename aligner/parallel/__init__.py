"""Rank discovery, megatron process groups and the CPU compatibility layer (see launch.py, cpu_compat.py)."""

from aligner.parallel.launch import RankInfo, discover, initialize, pick_backend, set_seed, shutdown

__all__ = ["RankInfo", "discover", "initialize", "pick_backend", "set_seed", "shutdown"]
