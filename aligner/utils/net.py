"""Free TCP ports on this machine (for rendezvous and for servers started by launchers and tests).

Ports are drawn outside the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
default): a port found free there can be handed to any outgoing connection of another process (gloo's rendezvous
opens dozens) in the moment before our server binds it, which made a critic's Triton fail to start on a busy 2-core
machine ("failed to start Metrics service: ... already in use"). Outside it only programs that bind a fixed port
compete, and the Slurm launchers are such programs: they take 20000 + (job id % 1270) x 10 + 0..5 (SLURM_PORTS), so
the pool lies above the ephemeral range (61000-65535 by default), else between the two, and overlaps the launchers'
ports only where nothing else is left (a CI run had a test's critic answer on a Slurm job's port). The draw is
random from the OS's entropy, not from `random` (jobs seed it alike).

Processes that draw at the same moment can still draw the same port and both find it free, the second bind failing
seconds later (a CI run: two pytest workers, a rendezvous port lost between the draw and the spawned rank's bind).
ALIGNER_PORT_SLICE=k/n gives each of n such drawers its own k-th part of the pool (tests/conftest.py sets it for
each pytest worker); the processes they start inherit it. One process drawing twice before either port is bound (a
launcher's critic ports and a job's rendezvous port) never gets a port it handed out in the last two minutes.
"""

from __future__ import annotations

import os
import random
import socket
import time

_DRAW = random.SystemRandom()
LOWEST = 20000  # the pool's floor: above the usual fixed service ports
HOLD_S = 120.0  # a port handed out is not handed out again by this process for this long (module docstring)
_HANDED: dict[int, float] = {}  # port -> when this process handed it out (time.monotonic)
SLICE_ENV = "ALIGNER_PORT_SLICE"  # "k/n": draw from the k-th of n equal parts of the pool (module docstring)
SLURM_PORTS = (20000, 32699)  # launchers/slurm/*.sbatch: PORT_BASE = 20000 + (job id % 1270) * 10, up to PORT_BASE + 5


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned local ports (the Linux default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _ports(n: int) -> tuple[int, int]:
    """[first, last] ports of the pool outside the ephemeral range: above it, else between the Slurm launchers'
    ports and it, else below it (module docstring); the first of these with room for a thousand and n."""
    lo, hi = ephemeral_range()
    for first, last in ((hi + 1, 65535), (SLURM_PORTS[1] + 1, lo - 1), (LOWEST, lo - 1)):
        if last - first + 1 >= 1000 + n:
            return first, last
    return 1024, 65535  # an unusual range that leaves no room outside: anywhere, checked below


class PortSliceError(ValueError):
    """ALIGNER_PORT_SLICE is not k/n (a user's setting: the jobs and the launcher report it in one line)."""


def port_slice() -> tuple[int, int]:
    """(k, n) from ALIGNER_PORT_SLICE=k/n; (0, 1), the whole pool, where it is unset."""
    value = os.environ.get(SLICE_ENV, "").strip()
    if not value:
        return 0, 1
    try:
        k, n = (int(v) for v in value.split("/"))
    except ValueError:
        k, n = -1, 0
    if not 0 <= k < n:
        raise PortSliceError(
            f"{SLICE_ENV}={value!r}: write k/n with 0 <= k < n (this process's part of n), or unset it"
        )
    return k, n


def _pool(n: int) -> tuple[int, int]:
    """[first, last] base ports for n consecutive ports inside this process's part of the pool (port_slice)."""
    first, last = _ports(n)
    k, parts = port_slice()
    width = (last - first + 1) // parts
    if width < n:
        raise PortSliceError(f"{SLICE_ENV}: {parts} parts of the {first}-{last} pool leave no room for {n} ports")
    first += k * width
    return first, first + width - n


def _all_free(host: str, base: int, n: int) -> bool:
    held = []
    try:
        for port in range(base, base + n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in held:
            s.close()


def free_port_range(n: int = 1, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port p such that p, p+1, ..., p+n-1 are all free now (the critic server takes HTTP, gRPC and metrics),
    outside the ephemeral range and not handed out by this process in the last HOLD_S seconds (module docstring)."""
    first, last = _pool(n)
    now = time.monotonic()
    for port in [p for p, when in _HANDED.items() if now - when >= HOLD_S]:
        del _HANDED[port]
    for _ in range(tries):
        base = _DRAW.randint(first, last)
        ports = range(base, base + n)
        if not any(p in _HANDED for p in ports) and _all_free(host, base, n):
            _HANDED.update(dict.fromkeys(ports, now))
            return base
    raise RuntimeError(f"no {n} consecutive free ports found on {host} in {first}-{last + n - 1}")
