"""Free TCP ports on this machine (for rendezvous and for servers started by launchers and tests)."""

from __future__ import annotations

import socket


def free_port_range(n: int = 1, host: str = "127.0.0.1", tries: int = 100) -> int:
    """A port p such that p, p+1, ..., p+n-1 are all free now (the critic server takes HTTP, gRPC and metrics)."""
    for _ in range(tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        held = []
        try:
            for port in range(base + 1, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                held.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found on {host}")
