"""`ParentThread`: start child processes from a thread that lives as long as this process.

Linux ties a child's parent-death signal (PR_SET_PDEATHSIG) to the thread that started the child, not to the process:
the child is signalled when that thread ends. PyTriton's tritonserver carries one (SIGTERM), and the critic starts
it in the background while it builds its models; so the starting thread stays, asleep, until the process ends.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Callable


class ParentThread:
    """Runs `start()` in a daemon thread now. `done` is set when it returned or raised (then `error` holds the
    exception); after a successful start the thread sleeps for the rest of the process's life."""

    def __init__(self, start: Callable[[], None], name: str):
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._start = start
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def interrupt(self, exc_type: type[Exception]) -> None:
        """Raise `exc_type` in the thread while `start()` still runs (at its next Python instruction: a wait in C
        code ends first), so that it returns early through its own error handling."""
        if not self.done.is_set():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread.ident), ctypes.py_object(exc_type))

    def frames(self) -> list[str]:
        """The thread's current stack as "file:function" entries, innermost first (empty once it ended)."""
        import sys

        frame, out = sys._current_frames().get(self._thread.ident), []
        while frame is not None:
            out.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")
            frame = frame.f_back
        return out

    def _run(self) -> None:
        try:
            self._start()
        except BaseException as exc:  # noqa: BLE001 - the caller reads it from `error`
            self.error = exc
        finally:
            self.done.set()
        if self.error is None:
            threading.Event().wait()
