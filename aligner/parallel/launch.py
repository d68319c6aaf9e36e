"""Rank discovery and the one place where communicators are made.

`discover()` reads who this process is from the launcher's environment: torchrun (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`), Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, master from the first host of
`SLURM_JOB_NODELIST`), Open MPI (`OMPI_COMM_WORLD_*`) or MPICH/Hydra (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
A plain `python script.py` is a world of one.

`initialize(...)` then, once per process: installs the CPU compatibility layer when there is no GPU,
picks the backend (NCCL on GPU, gloo on CPU), binds the local GPU, creates the default process group and
megatron-core's TP/PP/DP groups, and seeds megatron's RNG tracker. Nothing else in aligner creates communicators.

`host_group()` is a gloo group of every rank, made by `initialize` beside NCCL's default group: a rank that waits
for another rank's host-side work (the critic job's workers for rank 0's next command, the actor's ranks for rank
0's HTTP answer) waits in it, on the CPU. A pending NCCL collective is a kernel that spins on its GPU until the
data comes; on a GPU that another job shares (the critic beside an actor rank), that kernel takes the other job's
time slices: measured on 2x H200, a critic job at DP=2 beside the 8B actor's TP pair made its generation 2.2x
slower (docs/PERF.md, eighth session). None before `initialize` (then the default group serves). `host_barrier()`
and `host_broadcast(obj)` use it for the waits around checkpoints, run ids and output files.

`shutdown(exit_code_if_stuck)` destroys them at the end of a job. Whatever captured collectives into CUDA graphs
(the generation engine at TP > 1) must be closed before: NCCL's communicator teardown waits for those graphs, and
a TP=2 actor that kept them hung in `destroy_process_group` forever (seen on 2x H200, tests/gpu/probe_shutdown.py).
As a last guard, a teardown that does not return within `SHUTDOWN_TIMEOUT_S` is abandoned: the process logs it and
exits at once, so a finished job always releases its allocation.

Collective timeouts: every process group gets `timeout_minutes` (config `parallel.timeout_minutes`). On GPU, NCCL's
watchdog then reports the rank, the group and the operation (e.g. `[PG ID 5 PG GUID 8(TENSOR_MODEL_PARALLEL_GROUP)
Rank 0] ... WorkNCCL(SeqNum=25, OpType=ALLREDUCE ...) ran for 30025 milliseconds`) and tears the process down; we
turn off its flight-recorder dump on timeout unless asked for (TORCH_NCCL_DUMP_ON_TIMEOUT), which delayed the
teardown by more than 50 s. On CPU, gloo raises in the waiting collective after the same timeout.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
import sys
import threading
import traceback
from typing import NamedTuple

import torch

from aligner.parallel.device import on_gpu
from aligner.utils.net import free_port_range

DEFAULT_PORT = 29500
SHUTDOWN_TIMEOUT_S = 60.0
# NCCL's watchdog defaults that we set unless the user's environment already does (see the module docstring).
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}

log = logging.getLogger(__name__)
_HOST = None  # host_group(): (the default group it was made beside, the gloo group); made by initialize


class RankInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm", "openmpi", "mpich", "single"


def first_slurm_host(nodelist: str) -> str:
    """First host name of a Slurm node list, e.g. 'gpu-[003-005,9],cpu1' -> 'gpu-003' (what `scontrol show
    hostnames` prints first), without needing scontrol on the compute node."""
    nodelist = nodelist.strip()
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        raise ValueError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _env_int(env, *names):
    for name in names:
        if name in env and env[name] != "":
            return int(env[name])
    return None


def discover(env=None, master_addr: str | None = None, master_port: int | None = None) -> RankInfo:
    """Who am I? See the module docstring for the variables read; explicit arguments win over the environment."""
    env = os.environ if env is None else env
    port = master_port or _env_int(env, "MASTER_PORT") or DEFAULT_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        source, rank, world = "torchrun", int(env["RANK"]), int(env["WORLD_SIZE"])
        local = _env_int(env, "LOCAL_RANK") or 0
        addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        source, rank, world = "slurm", int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local = _env_int(env, "SLURM_LOCALID") or 0
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = master_addr or env.get("MASTER_ADDR") or (first_slurm_host(nodelist) if nodelist else "127.0.0.1")
        if master_port is None and "MASTER_PORT" not in env and "SLURM_JOB_ID" in env:
            # Two jobs on one node must not collide on the default port; derive one from the job and step ids.
            port = 20000 + (int(env["SLURM_JOB_ID"]) * 7 + (_env_int(env, "SLURM_STEP_ID") or 0)) % 20000
    elif "OMPI_COMM_WORLD_RANK" in env:
        source = "openmpi"
        rank, world = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        local = _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0
        addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    elif "PMI_RANK" in env:
        source = "mpich"
        rank, world = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
        local = _env_int(env, "MPI_LOCALRANKID", "PMI_LOCAL_RANK") or 0
        addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
    else:
        source, rank, world, local = "single", 0, 1, 0
        addr = master_addr or env.get("MASTER_ADDR", "127.0.0.1")
        if master_port is None and "MASTER_PORT" not in env:
            port = free_port_range()  # a world of one needs no agreed port; a fixed one would collide with other jobs
    if not 0 <= rank < world:
        raise ValueError(f"{source}: rank {rank} is outside a world of {world}")
    return RankInfo(rank, world, local, addr, int(port), source)


def pick_backend(requested: str = "auto") -> str:
    if requested not in ("auto", "nccl", "gloo"):
        raise ValueError(f"parallel.backend={requested!r}: use auto, nccl or gloo")
    if requested == "auto":
        return "nccl" if on_gpu() else "gloo"
    if requested == "nccl" and not on_gpu():
        raise ValueError("parallel.backend=nccl needs CUDA, and this process sees no GPU: use auto or gloo")
    return requested


def initialize(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    backend: str = "auto",
    seed: int = 1234,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout_minutes: float = 30,
) -> RankInfo:
    """Create the default process group (if the launcher has not) and megatron's model-parallel groups.

    Idempotent for the same layout; a second call with another layout is an error (communicators are static).
    """
    from megatron.core import parallel_state

    from aligner.parallel import cpu_compat

    cpu_compat.install()
    import torch.distributed as dist

    if dist.is_initialized():
        info = RankInfo(
            dist.get_rank(),
            dist.get_world_size(),
            int(os.environ.get("LOCAL_RANK", 0)),
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", 0)),
            "preinitialized",
        )
    else:
        info = discover(master_addr=master_addr, master_port=master_port)
        chosen = pick_backend(backend)
        if chosen == "nccl":
            for key, value in NCCL_ENV_DEFAULTS.items():
                os.environ.setdefault(key, value)
            torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
        dist.init_process_group(
            backend=chosen,
            init_method=f"tcp://{info.master_addr}:{info.master_port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    world = dist.get_world_size()
    if world % (tensor_parallel * pipeline_parallel):
        raise ValueError(
            f"world size {world} is not divisible by parallel.tensor_model_parallel_size ({tensor_parallel}) x "
            f"parallel.pipeline_model_parallel_size ({pipeline_parallel}): launch a multiple of "
            f"{tensor_parallel * pipeline_parallel} processes"
        )
    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if have != (tensor_parallel, pipeline_parallel):
            raise RuntimeError(f"model parallel groups already exist with TP,PP={have}; cannot remake them")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            create_gloo_process_groups=not on_gpu(),
            distributed_timeout_minutes=timeout_minutes,
        )
    global _HOST
    if host_group() is None:  # on CPU too (a second gloo group): the code path the GPUs run is the one tested
        _HOST = (dist.group.WORLD, dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes)))
    set_seed(seed)
    return info


def host_group():
    """The gloo group of every rank for host-side waits (see the module docstring); None (use the default group)
    before `initialize`, and once the default group it was made beside is gone."""
    import torch.distributed as dist

    if _HOST is not None and dist.is_initialized() and _HOST[0] is dist.group.WORLD:
        return _HOST[1]
    return None


def host_barrier() -> None:
    """A barrier for ranks that wait on another rank's host-side work (a file written, a lock taken): over
    `host_group()` where there is one (the waiting ranks block on the CPU), else the default group."""
    import torch.distributed as dist

    dist.barrier(group=host_group())


def host_broadcast(obj, src: int = 0):
    """Global rank `src`'s picklable `obj` on every rank, over `host_group()` where there is one, else the default
    group (on this process's device). Collective."""
    import torch
    import torch.distributed as dist

    from aligner.parallel.device import current_device

    group = host_group()
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group, device=torch.device("cpu") if group else current_device())
    return box[0]


def initialize_job(parallel, seed: int) -> RankInfo:
    """`initialize` from a job config's `parallel` section (aligner.config.schema.ParallelConfig)."""
    return initialize(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.backend,
        seed,
        parallel.master_addr,
        parallel.master_port,
        parallel.timeout_minutes,
    )


def is_logging_rank() -> bool:
    """The one rank that writes a job's metrics, samples and progress bar (global rank 0)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def set_seed(seed: int) -> None:
    """Seed torch (same on every rank) and megatron's tracker (distinct per TP rank inside TP regions)."""
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown(exit_code_if_stuck: int = 1, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Destroy megatron's groups and the default process group (see the module docstring for what must be closed
    first). If the teardown has not returned after `timeout_s`, log it and end the process with
    `exit_code_if_stuck` (the job's own result: its work is done or has failed already).

    Called from a `finally` while an exception propagates (a failed rank): the exception is named at once, and its
    traceback printed before an abandoned teardown ends the process (which would otherwise swallow it: the other
    ranks, still in a collective, are what keeps the teardown from returning)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    failure = sys.exc_info()[1]
    if isinstance(failure, (SystemExit, KeyboardInterrupt)):
        failure = None
    global _HOST
    _HOST = None
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if not dist.is_initialized():
        return
    rank = dist.get_rank()
    if failure is not None:
        log.error("rank %d failed (%s: %s); tearing down", rank, type(failure).__name__, failure)
    done = threading.Event()

    def destroy():
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="aligner-shutdown", daemon=True).start()
    if not done.wait(timeout_s):
        if failure is not None:
            traceback.print_exception(failure)
        log.error("rank %d: destroy_process_group did not return within %g s; exiting without it", rank, timeout_s)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code_if_stuck)
