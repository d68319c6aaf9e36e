"""aligner.utils.threads.ParentThread: its start function's outcome, and interrupt() ending a start that waits."""

import threading
import time

from aligner.utils.threads import ParentThread


class _Stop(Exception):
    pass


def test_a_start_that_returns_or_raises_is_reported():
    ok = ParentThread(lambda: None, "ok")
    assert ok.done.wait(10) and ok.error is None

    def fail():
        raise ValueError("no")

    bad = ParentThread(fail, "bad")
    assert bad.done.wait(10) and isinstance(bad.error, ValueError)


def test_interrupt_ends_a_start_that_polls_in_python():
    """A start polling in a loop of short sleeps (as PyTriton waits for tritonserver) ends with the exception at
    once; an interrupt after the start finished does nothing."""
    forever = threading.Event()

    def poll():
        while not forever.is_set():
            time.sleep(0.05)

    waiting = ParentThread(poll, "poll")
    time.sleep(0.2)
    assert not waiting.done.is_set()
    waiting.interrupt(_Stop)
    assert waiting.done.wait(10), "the start did not end"
    assert isinstance(waiting.error, _Stop)
    finished = ParentThread(lambda: None, "finished")
    assert finished.done.wait(10)
    finished.interrupt(_Stop)  # the thread now sleeps for the process's life: left alone
    time.sleep(0.2)
    assert finished.error is None
