"""One run per experiment directory: an advisory lock that a second run reports clearly.

`hold(directory, what)` takes an exclusive `flock` on `<directory>/.aligner.lock` and writes who holds it (pid, host,
time, what). The kernel releases it when the process ends, however it ends, so a crashed run never leaves it stuck.
A second run on the same directory gets `LockError` naming the holder. `hold_for_job(directory, what)` is the
collective form for a multi-rank job: global rank 0 takes the lock and every rank raises the same error.
(flock is advisory and local to a machine on some network filesystems: it guards against the common mistake of two
launches on one directory, not against every possible sharing.)
"""

from __future__ import annotations

import fcntl
import os
import socket
import time

LOCK_FILE = ".aligner.lock"


class LockError(RuntimeError):
    pass


class DirLock:
    def __init__(self, fd: int, path: str):
        self.fd, self.path = fd, path

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def hold(directory: str, what: str) -> DirLock:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise LockError(
            f"{directory} is in use by another run ({holder}): wait for it to end, or use another experiment directory"
        ) from None
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"{what}, pid {os.getpid()} on {socket.gethostname()}, since {stamp}\n".encode(), 0)
    return DirLock(fd, path)


def hold_for_job(directory: str, what: str) -> DirLock | None:
    """`hold` on global rank 0 (None on the other ranks); LockError on every rank when it is taken. Collective."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return hold(directory, what)
    lock, error = None, None
    if dist.get_rank() == 0:
        try:
            lock = hold(directory, what)
        except LockError as exc:
            error = str(exc)
    box = [error]
    dist.broadcast_object_list(box, src=0)  # torch picks the backend's device (the bound GPU under NCCL)
    if box[0] is not None:
        raise LockError(box[0])
    return lock
