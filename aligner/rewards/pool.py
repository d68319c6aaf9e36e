"""Worker processes that run a reward function with a per-call timeout. Imports no torch.

Contract
- `RewardPool(spec, num_workers, timeout_s, samples_per_call)` starts `num_workers` processes (spawned, not forked:
  forking a process that holds threads, a process group or a CUDA context is unsafe). Each imports the function of
  `spec` (aligner.rewards.function) once and reports ready, so a file that does not import fails at construction.
  Workers ignore SIGTERM/SIGINT: the job decides when to stop (a launcher's SIGTERM must let the step finish and the
  checkpoint be written); `close()` stops them, and they exit by themselves when the parent's end of the pipe closes.
- `score(prompts, responses, labels) -> np.ndarray` float32 [B], blocking, one caller at a time: the batch is cut
  into calls of `samples_per_call` consecutive samples, run on the free workers, and the scores come back in sample
  order. Every failure raises RewardFunctionError whose first line names the function and the sample (its index in
  the batch and the start of its prompt and response; for a call of several samples, the call's range):
    the function raised (SystemExit from sys.exit too)  -> the exception, then the function's traceback
    no answer within `timeout_s`                         -> the worker is killed and replaced
    the worker died (os._exit, a crash)                  -> its exit code; it is replaced
    not one number per sample, or a number that is not finite in float32 (the dtype the scores are used in)
  The pool stays usable after a failure (workers with a call in flight are replaced: their answer is stale).
- `close()` stops the workers (idempotent).
A sample's score depends only on the samples of its call, never on the number of workers.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import traceback
from collections import deque
from multiprocessing.connection import wait

import numpy as np

from aligner.rewards.function import RewardFunctionError, accepts_labels, call, load_function

START_TIMEOUT_S = 120.0  # importing the function in a fresh interpreter


def _worker_main(spec: str, conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        fn = load_function(spec)
    except RewardFunctionError as exc:
        conn.send(("load_error", str(exc), ""))
        return
    takes_labels = accepts_labels(fn)
    conn.send(("ready", None, ""))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent has gone
            return
        if msg is None:
            return
        prompts, responses, labels = msg
        try:
            out = call(fn, takes_labels, prompts, responses, labels)
        except BaseException as exc:  # noqa: BLE001 - SystemExit (sys.exit) is the function's failure too
            tb = exc.__traceback__
            for _ in range(2):  # this loop's frame and call()'s: ours, not the function's
                tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
            trace = "".join(traceback.format_exception(type(exc), exc, tb))
            conn.send(("raised", f"{type(exc).__name__}: {exc}", trace))
            continue
        try:
            scores = [float(x) for x in out]
        except (TypeError, ValueError) as exc:
            conn.send(("bad_return", f"returned {_short(out)}, not a list of numbers ({exc})", ""))
            continue
        conn.send(("ok", scores, ""))


def _short(x, n: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= n else text[: n - 3] + "..."


class _Worker:
    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(spec, child), name="reward-worker", daemon=True)
        self.proc.start()
        child.close()

    def wait_ready(self, spec: str) -> None:
        if not wait([self.conn, self.proc.sentinel], timeout=START_TIMEOUT_S):
            self.kill()
            raise RewardFunctionError(f"reward function {spec}: a worker did not start within {START_TIMEOUT_S:g} s")
        try:
            kind, message, _ = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RewardFunctionError(
                f"reward function {spec}: a worker exited with code {self.proc.exitcode} while importing it"
            ) from None
        if kind != "ready":
            self.kill()
            raise RewardFunctionError(message)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.proc.join(5)
        self.kill()


class RewardPool:
    def __init__(
        self,
        spec: str,
        num_workers: int = 2,
        timeout_s: float = 60.0,
        samples_per_call: int = 1,
        keys: str = "reward.",
    ):
        """`keys`: how the job's config names the settings (errors say e.g. `reward.timeout`)."""
        if num_workers < 1 or samples_per_call < 1 or not timeout_s > 0:
            raise ValueError("num_workers and samples_per_call must be >= 1 and timeout_s > 0")
        self.spec, self.timeout_s, self.samples_per_call = spec, float(timeout_s), samples_per_call
        self.keys = keys
        self._ctx = mp.get_context("spawn")
        self.workers: list[_Worker] = []
        try:
            self.workers = [_Worker(self._ctx, spec) for _ in range(num_workers)]
            for w in self.workers:
                w.wait_ready(spec)
        except BaseException:
            self.close()
            raise

    def _replace(self, i: int) -> None:
        self.workers[i].kill()
        self.workers[i] = _Worker(self._ctx, self.spec)
        self.workers[i].wait_ready(self.spec)

    def _error(self, lo: int, hi: int, batch: int, prompts, responses, what: str) -> RewardFunctionError:
        if hi - lo == 1:
            where = f"sample {lo} of {batch}"
        else:
            where = (
                f"one call on samples {lo}..{hi - 1} of {batch} ({self.keys}samples_per_call={self.samples_per_call})"
            )
        sample = f"prompt {_short(prompts[lo], 50)}, response {_short(responses[lo], 50)}"
        return RewardFunctionError(f"reward function {self.spec} failed on {where} ({sample}): {what}")

    def _check(self, msg, lo: int, hi: int, prompts, responses) -> np.ndarray:
        kind, payload, trace = msg
        batch = len(prompts)
        if kind == "raised":
            err = self._error(lo, hi, batch, prompts, responses, f"raised {payload}")
            err.args = (f"{err.args[0]}\n{trace.rstrip()}",)
            raise err
        if kind != "ok":
            raise self._error(lo, hi, batch, prompts, responses, payload)
        if len(payload) != hi - lo:
            raise self._error(
                lo, hi, batch, prompts, responses, f"returned {len(payload)} scores for {hi - lo} samples: one each"
            )
        scores = np.asarray(payload, dtype=np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            scores32 = scores.astype(np.float32)
        bad = np.flatnonzero(~np.isfinite(scores32))
        if bad.size:
            j = lo + int(bad[0])
            raise self._error(
                j,
                j + 1,
                batch,
                prompts,
                responses,
                f"returned {scores[bad[0]]!r}, which is not a finite float32 (scores must be finite numbers)",
            )
        return scores32

    def score(self, prompts: list, responses: list, labels: list | None = None) -> np.ndarray:
        batch = len(prompts)
        labels = list(labels) if labels is not None else [None] * batch
        if not len(responses) == len(labels) == batch:
            raise ValueError(f"{batch} prompts, {len(responses)} responses and {len(labels)} labels")
        k = self.samples_per_call
        todo = deque((lo, min(lo + k, batch)) for lo in range(0, batch, k))
        busy: dict[int, tuple[int, int, float]] = {}  # worker index -> (lo, hi, deadline)
        out = np.zeros(batch, dtype=np.float32)
        try:
            while todo or busy:
                for i, w in enumerate(self.workers):
                    if i not in busy and todo:
                        lo, hi = todo.popleft()
                        w.conn.send((prompts[lo:hi], responses[lo:hi], labels[lo:hi]))
                        busy[i] = (lo, hi, time.monotonic() + self.timeout_s)
                first_deadline = min(d for _, _, d in busy.values())
                handles = [h for i in busy for h in (self.workers[i].conn, self.workers[i].proc.sentinel)]
                wait(handles, timeout=max(0.0, first_deadline - time.monotonic()))
                for i in list(busy):
                    lo, hi, deadline = busy[i]
                    w = self.workers[i]
                    msg = None
                    if w.conn.poll():  # an answer first: a worker may answer and then die
                        try:
                            msg = w.conn.recv()
                        except (EOFError, OSError):
                            msg = None
                    if msg is not None:
                        del busy[i]
                        out[lo:hi] = self._check(msg, lo, hi, prompts, responses)
                    elif not w.proc.is_alive():
                        del busy[i]
                        w.proc.join(5)
                        code = w.proc.exitcode
                        self._replace(i)
                        raise self._error(
                            lo,
                            hi,
                            batch,
                            prompts,
                            responses,
                            f"its worker process exited with code {code} during the call (os._exit or a crash)",
                        )
                    elif time.monotonic() > deadline:
                        del busy[i]
                        self._replace(i)
                        raise self._error(
                            lo,
                            hi,
                            batch,
                            prompts,
                            responses,
                            f"no answer within {self.keys}timeout={self.timeout_s:g} s (the worker was killed)",
                        )
        except BaseException:
            for i in busy:  # their answers would arrive during the next batch
                self._replace(i)
            raise
        return out

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []
