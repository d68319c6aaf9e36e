"""Free TCP ports on this machine (for rendezvous and for servers started by launchers and tests).

Ports are drawn outside the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
default): a port found free there can be handed to any outgoing connection of another process (gloo's rendezvous
opens dozens) in the moment before our server binds it, which made a critic's Triton fail to start on a busy 2-core
machine ("failed to start Metrics service: ... already in use"). Below that range only programs that bind a fixed
port compete. The draw is random from the OS's entropy, not from `random` (jobs seed it alike).
"""

from __future__ import annotations

import random
import socket

_DRAW = random.SystemRandom()
LOWEST = 20000  # the pool's floor: above the usual fixed service ports


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned local ports (the Linux default where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _pool(n: int) -> tuple[int, int]:
    """[first, last] base ports outside the ephemeral range with room for n consecutive ports."""
    lo, hi = ephemeral_range()
    if lo - LOWEST >= 1000 + n:
        return LOWEST, lo - n
    if 65535 - hi >= 1000 + n:
        return hi + 1, 65536 - n
    return 1024, 65536 - n  # an unusual range that leaves no room outside: anywhere, checked below


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
    outside the ephemeral range (module docstring)."""
    first, last = _pool(n)
    for _ in range(tries):
        base = _DRAW.randint(first, last)
        if _all_free(host, base, n):
            return base
    raise RuntimeError(f"no {n} consecutive free ports found on {host} in {first}-{last + n - 1}")
