"""Run a test body in N real processes joined by gloo (the CPU stand-in for NCCL).

`run_ranks(fn, world_size, *args)` spawns `world_size` processes, each calls `fn(rank, world_size, *args)`
after `torch.distributed` is initialised with gloo, and the call returns the list of per-rank return values
(which must be picklable). A failure on any rank raises here with that rank's traceback.
The rendezvous store is served by this process on a port the OS hands it while binding (port 0), held from before
the ranks start: a port drawn free and bound seconds later by a spawned rank can be taken in between (a CI run).
`fn` must be importable (a module-level function), as with any spawned process.
The ranks are forked from a server process that imported torch, megatron-core and aligner once (multiprocessing's
forkserver, one per test process): a spawned rank imported them again, 5-9 s a rank on a CI machine. They start with
the environment the server started with, not the test's current one.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from aligner.utils.net import free_port_range as free_port  # noqa: F401  (tests import it from here)


def _worker(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Serialised to bytes: a tensor sent as-is travels as a shared-memory handle that dies with this process.
        buffer = io.BytesIO()
        torch.save(fn(rank, world_size, *args), buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            except Exception:  # noqa: BLE001
                pass
            dist.destroy_process_group()


# What the ranks of the suite import (torch._dynamo: torch.optim's first parameter group imports it); a module that
# fails to import here is left to the rank (forkserver's rule).
PRELOAD = [
    "torch.distributed",
    "torch._dynamo",
    "aligner",
    "megatron.core.models.gpt",
    "aligner.ppo.trainer",
    "aligner.critic.service",
    "aligner.generation.native.engine",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0):
    ctx = _context()
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    while len(results) < world_size and not errors:
        try:
            rank, ok, value = queue.get(timeout=1.0)
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                errors.append(f"rank(s) {dead} died without a report (exit codes {[procs[r].exitcode for r in dead]})")
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout:.0f} s; ranks done: {sorted(results)}")
            continue
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank} failed:\n{value}")
    for p in procs:
        p.join(timeout=timeout if not errors else 5)
        if p.is_alive():
            p.kill()
    del store  # its server closes once the ranks are gone
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
