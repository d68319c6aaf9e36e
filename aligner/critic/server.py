"""PyTriton binding of `CriticService`: rank 0 serves, every rank computes.

Contract
- `serve(service, cfg) -> exit code` is called on every rank after the service is built. Global rank 0 starts
  Triton with the endpoints of aligner.critic.protocol (reward-only mode: critic_infer alone) and runs
  `CriticServer`; the other ranks run `run_worker`, which waits for a command from rank 0 and runs the same service
  call. Rank 0 broadcasts a 5-integer header (op, B, T, flags, arg) over the host group (gloo: a waiting worker
  holds no GPU collective), then the tensors over the default group (both made by aligner.parallel.initialize).
- Threads: PyTriton calls the endpoint callables in its own threads. A callable validates its request (a bad one is
  answered at once with the reason), then queues a job for the main thread and waits for the result. Only the main
  thread broadcasts and runs models: the CPU compatibility layer's TorchFunctionMode is thread-local, collectives
  must run in one order on every rank, and a FIFO queue gives the ordering the actor relies on (a critic_infer that
  arrives while critic_train runs waits for it, so the next rollout sees the updated critic).
- Lifecycle: the ports are checked before start-up (a taken port is named); once every endpoint answers through the
  printed URL, rank 0 prints one line `critic server ready at http://HOST:PORT ...`. SIGTERM/SIGINT stop Triton
  (process and workspace) and the workers, exit 0. If tritonserver dies, the job exits 1 with the reason; an
  unexpected error while the ranks are in a collective also ends the job (exit 1): their state is then unknown.
  While idle, rank 0 sends a no-op every `server.heartbeat_s` so the workers' pending broadcast never times out.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from aligner.config.critic import CriticJobConfig, CriticServerConfig
from aligner.critic import protocol
from aligner.critic.auth import authorised, load_token
from aligner.critic.protocol import CriticRequestError, check_infer, check_run_id, check_step, check_train
from aligner.critic.reward_fn import RewardFunctionError
from aligner.parallel import host_group
from aligner.parallel.device import current_device, on_gpu

LOG = logging.getLogger(__name__)

OP_NOOP, OP_INFER, OP_TRAIN, OP_SAVE, OP_STOP, OP_RESUME = range(6)
_FLAG_PROMPT_LENGTHS = 1
_RUN_ID_BYTES = 64  # a run id travels to the other ranks as a fixed-size uint8 tensor


class PortInUseError(RuntimeError):
    pass


class TritonStartError(RuntimeError):
    pass


# -- environment and ports ---------------------------------------------------------------------------------
def ensure_libpython_on_library_path() -> None:
    """Triton's python-backend stub must load this interpreter's libpython: put its directory on LD_LIBRARY_PATH.

    tritonserver copies os.environ when it starts, so setting it here (before Triton starts) is enough.
    """
    libdir = sysconfig.get_config_var("LIBDIR")
    parts = [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    if libdir and libdir not in parts:
        os.environ["LD_LIBRARY_PATH"] = ":".join([libdir, *parts])


def bind_address(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise TritonStartError(
            f"server.host={host!r} cannot be resolved ({exc}): use an IP address or a host name of this machine"
        ) from exc


def port_taken_line(triton_log: str | None) -> str | None:
    """The message of tritonserver's log line saying that a port was in use (None without one, or without a log)."""
    try:
        with open(triton_log, errors="replace") as f:
            lines = [line for line in f if "already in use" in line]
    except (OSError, TypeError):
        return None
    if not lines:
        return None
    line = lines[-1].strip()
    return line.split('] "', 1)[-1].strip('" ') if '] "' in line else line


def public_url(server: CriticServerConfig) -> str:
    host = socket.gethostname() if server.host in ("0.0.0.0", "") else server.host
    return f"http://{host}:{server.port}"


def check_ports_free(server: CriticServerConfig) -> None:
    """Raise PortInUseError naming the first of the HTTP, gRPC and metrics ports that cannot be bound."""
    address = bind_address(server.host)
    for name, port in server.resolved_ports().items():
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # Like Triton's own listeners: a port left in TIME_WAIT by a previous server is usable.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((address, port))
            except OSError as exc:
                key = {"HTTP": "server.port", "gRPC": "server.grpc_port", "metrics": "server.metrics_port"}[name]
                raise PortInUseError(
                    f"port {port} ({name}) on {server.host} is already in use ({exc.strerror}): another critic "
                    f"server or program holds it. Stop it, or pick free ports with server.port=... (gRPC and "
                    f"metrics default to port+1 and port+2; set {key}=... to move only this one)"
                ) from exc


def _python_stubs(workspace: str | None = None) -> list:
    """Triton python-backend stub processes started (through tritonserver) by this process, and, with `workspace`
    (the folder of this server's PyTriton workspace), those run from it whatever their parent: a stub whose
    tritonserver died first (a job step's SIGTERM reaches every process of the step) is a child of init, and one was
    found alive, idle, long after a CI run's Slurm test had ended."""
    import psutil

    def is_stub(p) -> bool:
        line = " ".join(p.cmdline())
        return "triton_python_backend_stub" in line and (workspace is None or os.path.join(workspace, "") in line)

    out, seen = [], set()
    mine = psutil.Process().children(recursive=True)
    others = psutil.process_iter() if workspace is not None else ()
    for p in (*mine, *others):
        try:
            if p.pid not in seen and is_stub(p):
                out.append(p)
                seen.add(p.pid)
        except psutil.Error:
            pass
    return out


def _with_descendants(procs: list) -> list:
    """`procs` and every process below them (a stub's python starts a multiprocessing resource tracker)."""
    import psutil

    out = list(procs)
    for p in procs:
        try:
            out += p.children(recursive=True)
        except psutil.Error:
            pass
    return out


def end_processes(procs: list, timeout: float = 10.0, grace: float = 5.0) -> list:
    """Wait up to `timeout` s for `procs` (psutil.Process) to exit; SIGTERM those still running, and SIGKILL what is
    left `grace` s later. Returns the ones this had to end. A process found gone, or not ours to signal, is skipped."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _, still = psutil.wait_procs(alive, timeout=grace)
        if not still:
            break
    return alive


# -- command channel (rank 0 -> all ranks) ----------------------------------------------------------------
class CommandChannel:
    """Commands from global rank 0 (a no-op in a world of one): the header over the host group, so that a worker
    waiting for the next command holds no GPU collective (aligner.parallel.launch, host_group: a pending NCCL
    broadcast spins on a GPU the actor may share), then the tensors over the default group."""

    def __init__(self, device: torch.device):
        self.device = device
        self.active = dist.is_initialized() and dist.get_world_size() > 1

    def send(self, op: int, batch: int = 0, seq: int = 0, flags: int = 0, arg: int = 0, tensors=()) -> None:
        if not self.active:
            return
        header = torch.tensor([op, batch, seq, flags, arg], dtype=torch.int64)
        dist.broadcast(header, src=0, group=host_group())
        for t in tensors:
            dist.broadcast(torch.as_tensor(t).to(self.device).contiguous(), src=0)

    def recv(self) -> tuple[int, int, int, int, int]:
        header = torch.empty(5, dtype=torch.int64)
        dist.broadcast(header, src=0, group=host_group())
        return tuple(int(v) for v in header.tolist())

    def recv_tensor(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(t, src=0)
        return t


def _run_id_tensor(run_id: str) -> torch.Tensor:
    t = torch.zeros(_RUN_ID_BYTES, dtype=torch.uint8)
    raw = run_id.encode("ascii")
    t[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    return t


def _run_id_from(t: torch.Tensor) -> str:
    return bytes(v for v in t.cpu().tolist() if v).decode("ascii")


def _infer_tensors(tokens, lengths, prompt_lengths):
    return [torch.from_numpy(tokens), torch.from_numpy(lengths)] + (
        [torch.from_numpy(prompt_lengths)] if prompt_lengths is not None else []
    )


def run_worker(service, channel: CommandChannel) -> int:
    """Ranks other than 0: run every command rank 0 broadcasts until OP_STOP; returns the exit code it carries."""
    while True:
        op, batch, seq, flags, arg = channel.recv()
        if op == OP_STOP:
            return arg
        if op == OP_NOOP:
            continue
        if op in (OP_SAVE, OP_RESUME):
            run_id = _run_id_from(channel.recv_tensor((_RUN_ID_BYTES,), torch.uint8))
            try:
                service.save(arg, run_id) if op == OP_SAVE else service.resume(arg, run_id)
            except CriticRequestError:
                pass  # raised identically on rank 0, which answers the client; all ranks stay in step
            continue
        tokens = channel.recv_tensor((batch, seq), torch.int64)
        lengths = channel.recv_tensor((batch,), torch.int64)
        if op == OP_INFER:
            prompt_lengths = channel.recv_tensor((batch,), torch.int64) if flags & _FLAG_PROMPT_LENGTHS else None
            try:
                service.infer(tokens, lengths, prompt_lengths)
            except RewardFunctionError:
                pass  # rank 0 reports it to the client; all ranks stay in step
        elif op == OP_TRAIN:
            returns, prev_values, mask = (channel.recv_tensor((batch, seq), torch.float32) for _ in range(3))
            service.train(tokens, lengths, returns, prev_values, mask)
        else:
            raise RuntimeError(f"unknown command {op} from rank 0")


# -- rank 0 ------------------------------------------------------------------------------------------------
@dataclass
class _Job:
    op: int
    args: tuple
    future: Future


class _ShuttingDown(RuntimeError):
    pass


class _NoTraceback:
    """Mixed into what a refused request raises to PyTriton: PyTriton formats the exception with its traceback for
    the client, and a client must see the reason, not the server's code and file paths (the job's log has them)."""

    @property
    def __traceback__(self):
        return None

    @__traceback__.setter
    def __traceback__(self, value):
        pass


_REPLY_TYPES: dict[type, type] = {}


def _reply(exc: BaseException) -> BaseException:
    """`exc` as the client should see it: same class name and message, no traceback, no chained causes."""
    if not isinstance(exc, (CriticRequestError, RewardFunctionError, _ShuttingDown)):
        what = type(exc).__name__
        if what == "OutOfMemoryError":  # torch's: name the critic's settings that take less
            what += ": lower its train.micro_batch_size or infer.micro_batch_size, or give it GPUs of its own"
        exc = RuntimeError(f"the critic job failed on this request ({what}); see its log")
    cls = type(exc)
    if cls not in _REPLY_TYPES:
        _REPLY_TYPES[cls] = type(cls.__name__, (_NoTraceback, cls), {"__module__": "critic"})
    reply = _REPLY_TYPES[cls](*exc.args)
    reply.__suppress_context__ = True
    return reply


def _answers(endpoint):
    """An endpoint callable for PyTriton whose errors reach the client as `_reply` makes them."""

    def call(requests):
        try:
            return endpoint(requests)
        except Exception as exc:  # noqa: BLE001 - every error leaves through _reply
            raise _reply(exc) from None

    return call


class _TritonExited(Exception):
    """Raised in the Triton start thread when tritonserver exited while PyTriton was still waiting for it."""


TEXT_FILE_BUSY_ATTEMPTS = 3  # Triton starts tried where the first fail on ETXTBSY (retry_text_file_busy)


def text_file_busy(exc: BaseException) -> bool:
    """Whether a start failed to execute a file still open for writing (ETXTBSY), however wrapped (sh's
    ForkException carries the child's OSError as text)."""
    return getattr(exc, "errno", None) == errno.ETXTBSY or "Text file busy" in repr(exc)


def retry_text_file_busy(
    start: Callable[[], None], clean_up: Callable[[], None], attempts: int = TEXT_FILE_BUSY_ATTEMPTS, wait_s=0.5
) -> None:
    """start(), again (after clean_up() and a pause) while it fails on ETXTBSY, up to `attempts` times in all.

    PyTriton copies tritonserver into its workspace and executes the copy at once; a process forked meanwhile by any
    thread of ours (a library's subprocess while the models build) inherits the copy's open write handle and holds
    it until it executes or exits, and the execution fails with "Text file busy" (seen in CI). Any other error is
    raised at once."""
    for attempt in range(attempts):
        try:
            return start()
        except Exception as exc:
            if attempt + 1 == attempts or not text_file_busy(exc):
                raise
            LOG.warning("Triton's start met a file still being written (%r); starting again", exc)
            clean_up()
            time.sleep(wait_s * (attempt + 1))


LOAD_TOGETHER_MIN_CPUS = 8  # see load_together


def load_together(cpus: int | None = None) -> bool:
    """Whether tritonserver loads the endpoints together: written to PyTriton's model store before it starts (its
    default loads them one after another once it runs, a python stub's start each, ~2 s on the CPU demo).

    Only on a machine of LOAD_TOGETHER_MIN_CPUS or more: on two cores, four stubs (each spawning a helper) starting at
    once beside a two-rank actor left one endpoint's load unfinished (a CI-like run; tritonserver.log: the stub's
    instance initialize never returned). One after another, as the critic loaded them up to ce0fed9, never did.
    """
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return cpus >= LOAD_TOGETHER_MIN_CPUS


TRITON_EXIT_WAIT_S = 20.0  # tritonserver's exit: up to exit_timeout_secs (3) per wait, with room for a loaded machine


def start_failure(
    exc: Exception,
    server: CriticServerConfig,
    triton_log: str | None,
    tritonserver_running: Callable[[], bool],
    death_reason: Callable[[], str],
    exit_wait: float = TRITON_EXIT_WAIT_S,
) -> Exception:
    """The error that explains a failed Triton start (`exc`: PyTriton's, or _TritonExited): a port another program
    took (PortInUseError: the local launcher starts again on other ports), else TritonStartError.

    The ports are checked once our own tritonserver is gone: after a failed start it is often still exiting (stopped,
    or signalled with the job) and it keeps its ports while it waits for open connections, so an earlier check would
    blame them on another program (seen in CI: a start on a loaded machine, ended by a signal while an endpoint was
    still loading, reported as "port ... is already in use")."""
    deadline = time.monotonic() + exit_wait
    while tritonserver_running() and time.monotonic() < deadline:
        time.sleep(0.1)
    if tritonserver_running():
        return TritonStartError(
            f"Triton failed to start: {exc!r}; tritonserver still ran {exit_wait:g} s later; see {triton_log}"
        )
    try:
        check_ports_free(server)  # taken since the first check? Triton reports that as a misleading 403
    except PortInUseError as port_exc:
        return port_exc
    taken = port_taken_line(triton_log)  # held for a moment only (e.g. an outgoing connection)
    if taken:
        return PortInUseError(
            f"Triton could not bind a port that was free a moment before ({taken}): another program took it."
            " Start again, or pick other ports with server.port=..."
        )
    if isinstance(exc, _TritonExited):
        return TritonStartError(death_reason())
    return TritonStartError(f"Triton failed to start: {exc!r}; see {triton_log}")


class CriticServer:
    """Rank 0: Triton endpoints -> FIFO queue -> main thread (broadcast, then the service).

    Triton (its process and one python stub per endpoint, ~2 s each to load) starts in a thread while the main thread
    builds the service (the models): a request that comes before the service is there waits in the queue."""

    def __init__(self, cfg: CriticJobConfig, channel: CommandChannel):
        self.service, self.cfg, self.channel = None, cfg, channel
        self._service_ready = threading.Event()
        self._starting = None  # the ParentThread that starts Triton
        self.url = public_url(cfg.server)
        self.endpoints = (protocol.INFER,) if cfg.reward_only else protocol.ENDPOINTS
        self._jobs: queue.Queue[_Job] = queue.Queue()
        self._lock = threading.Lock()
        self._closing = False
        self._signal = None
        self._triton = None
        self._workspace = None  # the folder that holds PyTriton's workspace, removed by _shutdown
        self.token = load_token(cfg.server.token_file)

    # Triton threads ---------------------------------------------------------------------------------------
    def _submit(self, op: int, args: tuple) -> dict:
        job = _Job(op, args, Future())
        with self._lock:
            if self._closing:
                raise _ShuttingDown("the critic server is shutting down")
            self._jobs.put(job)
        return job.future.result()

    def _authorise(self, request) -> None:
        if not authorised(request.parameters, self.token):
            raise CriticRequestError(
                "unauthorized: this critic job requires the run's secret (the actor reads it from "
                "ALIGNER_CRITIC_TOKEN or critic.token_file; the launchers set it)"
            )

    def _limits(self):
        """The service's request limits, once it is built (Triton may answer before that)."""
        while not self._service_ready.wait(0.5):
            if self._closing:
                raise _ShuttingDown("the critic server is shutting down")
        return self.service.limits

    def _infer_endpoint(self, requests):
        limits = self._limits()
        out = []
        for r in requests:
            self._authorise(r)
            d = r.data
            args = check_infer(d.get("tokens"), d.get("lengths"), d.get("prompt_lengths"), d.get("labels"), limits)
            out.append(self._submit(OP_INFER, args))
        return out

    def _train_endpoint(self, requests):
        limits = self._limits()
        out = []
        for r in requests:
            self._authorise(r)
            d = r.data
            args = check_train(
                d.get("tokens"), d.get("lengths"), d.get("returns"), d.get("prev_values"), d.get("mask"), limits
            )
            out.append(self._submit(OP_TRAIN, args))
        return out

    def _save_endpoint(self, requests):
        out = []
        for r in requests:
            self._authorise(r)
            args = (check_step(r.data.get("step")), check_run_id(r.data.get("run_id")))
            out.append(self._submit(OP_SAVE, args))
        return out

    def _resume_endpoint(self, requests):
        out = []
        for r in requests:
            self._authorise(r)
            args = (check_step(r.data.get("step"), allow_fresh=True), check_run_id(r.data.get("run_id")))
            out.append(self._submit(OP_RESUME, args))
        return out

    # main thread ------------------------------------------------------------------------------------------
    def _run(self, job: _Job) -> dict:
        if job.op == OP_INFER:
            tokens, lengths, prompt_lengths, labels = job.args
            flags = _FLAG_PROMPT_LENGTHS if prompt_lengths is not None else 0
            self.channel.send(OP_INFER, *tokens.shape, flags, 0, _infer_tensors(tokens, lengths, prompt_lengths))
            values, rewards = self.service.infer(tokens, lengths, prompt_lengths, labels)
            return {"values": values.numpy(), "rewards": rewards.numpy()}
        if job.op == OP_TRAIN:
            tokens, lengths, returns, prev_values, mask = job.args
            self.channel.send(
                OP_TRAIN,
                *tokens.shape,
                0,
                0,
                [torch.from_numpy(x) for x in (tokens, lengths, returns, prev_values, mask)],
            )
            metrics = self.service.train(tokens, lengths, returns, prev_values, mask)
            return {k: np.array([metrics[k]], dtype=np.float32) for k in protocol.TRAIN_METRICS}
        step, run_id = job.args
        self.channel.send(job.op, arg=step, tensors=[_run_id_tensor(run_id)])
        if job.op == OP_SAVE:
            path = self.service.save(step, run_id)
        else:
            path = self.service.resume(step, run_id) or ""
        return {"path": np.array([path.encode()], dtype=object)}

    def _execute(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result = self._run(job)
        except (CriticRequestError, RewardFunctionError) as exc:
            job.future.set_exception(exc)  # raised identically on every rank: the ranks are still in step
            return
        except Exception as exc:
            job.future.set_exception(exc)
            if self.channel.active:
                raise  # another rank may be waiting inside a collective: end the job rather than hang
            LOG.exception("request failed; the single-rank server keeps serving")
            return
        job.future.set_result(result)

    def _on_signal(self, signum, _frame) -> None:
        # Recorded only, also during the models' build: serve() stops once the build and Triton's start are done. An
        # exception raised here would land wherever the main thread is, inside an import too, where it once left the
        # interpreter's import lock held and Triton's start thread waiting for it forever (seen in a test).
        self._signal = signum

    def _start_triton(self) -> None:
        from pytriton.triton import Triton, TritonConfig, TritonLifecyclePolicy

        s = self.cfg.server
        ports = s.resolved_ports()
        address = bind_address(s.host)
        os.makedirs(os.path.dirname(os.path.abspath(self.cfg.triton_log_file)), exist_ok=True)
        ensure_libpython_on_library_path()
        config = TritonConfig(
            http_address=address,
            http_port=ports["HTTP"],
            grpc_address=address,
            grpc_port=ports["gRPC"],
            metrics_address=address,
            metrics_port=ports["metrics"],
            allow_gpu_metrics=on_gpu(),
            log_file=self.cfg.triton_log_file,
            # The endpoints are unloaded before stop() (see _unload_endpoints); what is left
            # for tritonserver's exit is waiting for clients' keep-alive connections.
            exit_timeout_secs=3,
        )
        # PyTriton's own clean-up of its workspace runs while the python stubs may still be exiting, and gives up
        # with a warning on the first error (a CI run found a workspace left): a folder of ours, removed by
        # _shutdown after the stubs are gone. Short, like PyTriton's own name: its unix sockets live in it.
        from pytriton.constants import PYTRITON_HOME

        os.makedirs(PYTRITON_HOME, exist_ok=True)

        def start() -> None:
            self._workspace = tempfile.mkdtemp(prefix="critic_", dir=PYTRITON_HOME)
            policy = TritonLifecyclePolicy(launch_triton_on_startup=True, local_model_store=load_together())
            self._triton = Triton(
                config=config, workspace=os.path.join(self._workspace, "w"), triton_lifecycle_policy=policy
            )
            self._bind_endpoints()
            self._triton.run()

        def clean_up() -> None:  # a start that failed before tritonserver ran: its PyTriton and workspace
            try:
                self._triton.stop()
            except Exception:  # noqa: BLE001 - best effort; the next start uses a new workspace
                LOG.warning("stopping PyTriton after a failed start failed", exc_info=True)
            shutil.rmtree(self._workspace, ignore_errors=True)

        try:
            retry_text_file_busy(start, clean_up)
        except Exception as exc:
            raise self._start_failure(exc) from exc
        self._check_endpoints()

    def _bind_endpoints(self) -> None:
        from pytriton.model_config import ModelConfig, Tensor

        i64, f32 = np.int64, np.float32
        no_batching = ModelConfig(batching=False)  # shapes include B; the server checks B itself, with clear errors
        self._triton.bind(
            protocol.INFER,
            _answers(self._infer_endpoint),
            config=no_batching,
            inputs=[
                Tensor(name="tokens", dtype=i64, shape=(-1, -1)),
                Tensor(name="lengths", dtype=i64, shape=(-1, 1)),
                Tensor(name="prompt_lengths", dtype=i64, shape=(-1, 1), optional=True),
                Tensor(name="labels", dtype=bytes, shape=(-1, 1), optional=True),
            ],
            outputs=[
                Tensor(name="values", dtype=f32, shape=(-1, -1)),
                Tensor(name="rewards", dtype=f32, shape=(-1, 1)),
            ],
        )
        if not self.cfg.reward_only:  # reward-only mode (no value model): critic_infer alone, values zeros [B, 1]
            self._triton.bind(
                protocol.TRAIN,
                _answers(self._train_endpoint),
                config=no_batching,
                inputs=[
                    Tensor(name="tokens", dtype=i64, shape=(-1, -1)),
                    Tensor(name="lengths", dtype=i64, shape=(-1, 1)),
                    *(Tensor(name=n, dtype=f32, shape=(-1, -1)) for n in ("returns", "prev_values", "mask")),
                ],
                outputs=[Tensor(name=n, dtype=f32, shape=(1,)) for n in protocol.TRAIN_METRICS],
            )
            for name, endpoint in ((protocol.SAVE, self._save_endpoint), (protocol.RESUME, self._resume_endpoint)):
                self._triton.bind(
                    name,
                    _answers(endpoint),
                    config=no_batching,
                    inputs=[
                        Tensor(name="step", dtype=i64, shape=(1,)),
                        Tensor(name="run_id", dtype=bytes, shape=(1,)),
                    ],
                    outputs=[Tensor(name="path", dtype=bytes, shape=(1,))],
                )

    def _start_failure(self, exc: Exception) -> Exception:
        return start_failure(
            exc, self.cfg.server, self.cfg.triton_log_file, self._tritonserver_running, self._triton_death_reason
        )

    def _tritonserver_alive(self) -> bool | None:
        """Whether the tritonserver process runs: None before it started or where PyTriton's private handle cannot
        be read (best effort)."""
        running = getattr(getattr(self._triton, "_triton_server", None), "_tritonserver_running_cmd", None)
        try:
            return None if running is None else bool(running.is_alive())
        except Exception:  # noqa: BLE001 - an internal of PyTriton's that changed: no answer
            return None

    def _tritonserver_exited(self) -> bool:
        return self._tritonserver_alive() is False

    def _tritonserver_running(self) -> bool:
        return self._tritonserver_alive() is True

    def _wait_for_start(self) -> BaseException | None:
        """Wait for the Triton start thread and return its error (None: started). When tritonserver exits before
        it is ready (a port another program took after the port check), PyTriton keeps polling its HTTP port for up
        to two minutes, holding the lock its stop() needs; the exit is noticed here instead, and the start thread is
        interrupted (_TritonExited), so that the start fails at once with the reason."""
        interrupted = False
        while not self._starting.done.wait(0.2):
            if interrupted or not self._tritonserver_exited():
                continue
            # only while it sleeps in PyTriton's wait, never inside an import (an exception there leaves the
            # interpreter's import lock held)
            frames = self._starting.frames()
            if any(f.endswith(":wait_for_server_ready") for f in frames) and not any("importlib" in f for f in frames):
                self._starting.interrupt(_TritonExited)
                interrupted = True
        return self._starting.error

    def _check_endpoints(self) -> None:
        """Answer through the printed URL before announcing it (catches a host name that does not reach us)."""
        from pytriton.client import ModelClient

        url = self.url if self.cfg.server.host not in ("0.0.0.0", "") else f"http://127.0.0.1:{self.cfg.server.port}"
        timeout = self.cfg.server.ready_timeout
        for name in self.endpoints:
            try:
                with ModelClient(url, name, init_timeout_s=timeout) as client:
                    client.wait_for_model(timeout)
            except Exception as exc:
                raise TritonStartError(
                    f"endpoint {name} did not answer at {url} within server.ready_timeout="
                    f"{timeout} s ({exc!r}); see {self.cfg.triton_log_file}"
                ) from exc
        # "Ready" means every port is ours: a port taken between the free-port check and Triton's start makes
        # tritonserver exit (or leaves another program answering there), and a launcher must not start the actor.
        ports = self.cfg.server.resolved_ports()
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        try:
            with urllib.request.urlopen(f"http://{host}:{ports['metrics']}/metrics", timeout=10) as resp:
                ours = resp.status == 200 and b"nv_" in resp.read(1 << 16)
        except OSError:
            ours = False
        if not self._triton.is_alive():
            check_ports_free(self.cfg.server)  # names a port another program took (PortInUseError)
            raise TritonStartError(self._triton_death_reason())
        if not ours:
            raise TritonStartError(
                f"Triton's metrics port {ports['metrics']} does not answer as Triton (taken by another program "
                f"since the port check?); see {self.cfg.triton_log_file}"
            )

    def _unload_endpoints(self, log_level: int = logging.WARNING, timeout: float = 30.0) -> None:
        """Unload the endpoints while Triton still runs, so that their python stubs exit cleanly.

        tritonserver's own exit first waits (up to exit_timeout) for open client connections, which an actor
        keeps, and then kills the stubs still loaded: they can outlive it and leave their model folders in /tmp.
        """
        import contextlib

        import tritonclient.http as httpclient
        from pytriton.client.auth import create_auth_headers

        if not self._triton.is_alive():
            return
        host = "127.0.0.1" if self.cfg.server.host in ("0.0.0.0", "") else bind_address(self.cfg.server.host)
        try:
            headers = create_auth_headers(self._triton.get_access_token(), "http")
            with contextlib.closing(
                httpclient.InferenceServerClient(f"{host}:{self.cfg.server.port}", network_timeout=timeout)
            ) as client:
                for name in self.endpoints:
                    client.unload_model(name, headers=headers)
            self._close_connectors()
            # The unload call returns before the stubs have gone: wait for those processes themselves.
            deadline = time.monotonic() + timeout
            while _python_stubs() and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001 - stop() still runs; this only makes it cleaner
            LOG.log(log_level, "could not unload the endpoints before stopping Triton: %r", exc)

    def _close_connectors(self) -> None:
        """Ask PyTriton's request threads of each endpoint to end now, while the stubs unload: each notices once a
        second, and stop() would ask them only after the stubs have gone, then wait for them (1-2 s of every
        shutdown here). Best effort: PyTriton keeps them private; stop() asks again."""
        try:
            for model in self._triton._model_manager.models:
                for connector in model._requests_respones_connectors:
                    connector.close()
        except Exception as exc:  # noqa: BLE001 - another PyTriton than setup.py's pin: the stop is slower only
            LOG.warning("could not close PyTriton's request threads early (%r): the stop takes a second longer", exc)

    def _triton_death_reason(self) -> str:
        detail = ""
        try:  # best effort: PyTriton keeps the process handle private
            detail = f" with exit code {self._triton._triton_server._tritonserver_running_cmd.exit_code}"
        except Exception:  # noqa: BLE001
            pass
        return (
            f"tritonserver (or an endpoint's python stub) exited unexpectedly{detail}; "
            f"its log: {self.cfg.triton_log_file}"
        )

    def _signalled(self, grace: float = 0.0) -> bool:
        """Whether SIGTERM/SIGINT arrived, waiting up to `grace` s for it: a launcher (srun, torchrun) signals
        every rank at once, so a collective can fail on a dead peer a moment before our own signal is handled."""
        deadline = time.monotonic() + grace
        while self._signal is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the handler runs on this (main) thread between these calls
        return self._signal is not None

    def _loop(self) -> int:
        world = dist.get_world_size() if dist.is_initialized() else 1
        last_command = last_request = time.monotonic()
        idle_limit = self.cfg.server.idle_timeout_s
        while True:
            if self._signal is not None:
                return 0
            if idle_limit is not None and time.monotonic() - last_request > idle_limit:
                print(
                    f"critic server: no request for {idle_limit:g} s (server.idle_timeout_s): the actor job is gone; "
                    "stopping",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            if not self._triton.is_alive():
                if self._signalled(1.0):  # tritonserver got the same signal (same process group) and went first
                    return 0
                print(f"critic server: {self._triton_death_reason()}", file=sys.stderr, flush=True)
                return 1
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                if world > 1 and time.monotonic() - last_command > self.cfg.server.heartbeat_s:
                    try:
                        self.channel.send(OP_NOOP)
                    except Exception as exc:
                        raise RuntimeError(
                            f"lost contact with the other ranks of the critic job ({exc}); "
                            f"did one of them die? See its log"
                        ) from exc
                    last_command = time.monotonic()
                continue
            self._execute(job)
            last_command = last_request = time.monotonic()

    def _shutdown(self, code: int, tell_ranks: bool = True) -> None:
        with self._lock:
            self._closing = True
        while True:  # answer whatever is still queued, so Triton's handler threads return at once
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job.future.set_exception(_ShuttingDown("the critic server is shutting down"))
        # After a signal, tritonserver and the other ranks may have received it too and be gone: not worth a warning.
        level = logging.INFO if self._signal is not None else logging.WARNING
        if self._triton is not None:
            self._unload_endpoints(level)
            # PyTriton's stop runs a full gc.collect() for each endpoint (~0.3 s each with torch and megatron
            # loaded); objects that live until exit need not be scanned again: moved out of the collector's view.
            gc.freeze()
            # Found while tritonserver still runs (once it is gone they are children of init, not ours), and by
            # their workspace if it has gone first: then they get a short wait only (they would exit with it)
            triton_ran = self._triton.is_alive()
            stubs = _with_descendants(_python_stubs(self._workspace))
            self._triton.stop()
            # Stubs and their helpers may still be exiting (or not exit at all): the job ends after them, never
            # leaving one behind (CI runs found one alive just after its job had ended, and one long after).
            forced = end_processes(stubs, timeout=10.0 if triton_ran else 1.0)
            if forced:
                LOG.log(level, "ended %d python stub process(es) left after Triton stopped", len(forced))
        if self._workspace is not None:
            shutil.rmtree(self._workspace, ignore_errors=True)
            if os.path.exists(self._workspace):
                LOG.warning("could not remove the Triton workspace %s; remove it by hand", self._workspace)
        if self.service is not None:
            self.service.close()
        if not tell_ranks:
            return
        try:
            self.channel.send(OP_STOP, arg=code)
        except Exception as exc:  # noqa: BLE001 - the other ranks may already be gone
            LOG.log(level, "could not tell the other ranks to stop: %r", exc)

    def serve(self, build_service) -> int:
        """Start Triton and build the service (`build_service()`) at the same time, then serve until stopped; an
        exception of the build (a user's mistake: a config or checkpoint error) is raised after Triton stopped."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        # Imported here, not in the thread: two threads importing at once can deadlock on module locks.
        import pytriton.client  # noqa: F401
        import pytriton.model_config  # noqa: F401
        import pytriton.triton  # noqa: F401

        from aligner.utils.threads import ParentThread

        try:
            # tritonserver carries a parent-death signal (PyTriton's): started from a thread that stays.
            self._starting = ParentThread(self._start_triton, "critic-triton-start")
            start_error = None
            try:
                self.service = build_service()
            finally:
                if self._starting is not None:
                    start_error = self._wait_for_start()
        except BaseException:
            # The other ranks are not serving yet (they failed alike, or were stopped by the same signal): no OP_STOP.
            self._shutdown(1, tell_ranks=False)
            for s, handler in previous.items():
                signal.signal(s, handler)
            raise
        if self._signal is not None:  # SIGTERM/SIGINT while the models were built or Triton started
            self._shutdown(0, tell_ranks=False)
            for s, handler in previous.items():
                signal.signal(s, handler)
            name = signal.Signals(self._signal).name
            print(f"critic server: {name} received, stopping (before it was ready)", flush=True)
            return 0
        self._service_ready.set()
        code = 1
        try:
            if start_error is not None:
                raise start_error
            world = dist.get_world_size() if dist.is_initialized() else 1
            from megatron.core import parallel_state as ps

            print(
                f"critic server ready at {self.url} (endpoints {', '.join(self.endpoints)}; {world} rank(s): "
                f"TP {ps.get_tensor_model_parallel_world_size()}, PP {ps.get_pipeline_model_parallel_world_size()},"
                f" DP {ps.get_data_parallel_world_size()})",
                flush=True,
            )
            code = self._loop()
        except Exception as exc:
            if self._signalled(2.0):
                code = 0
            else:
                if not isinstance(exc, (PortInUseError, TritonStartError)):
                    traceback.print_exc()
                print(f"critic server failed: {exc}", file=sys.stderr, flush=True)
        finally:
            if self._signal is not None:
                print(f"critic server: {signal.Signals(self._signal).name} received, stopping", flush=True)
            self._shutdown(code)
            for s, handler in previous.items():
                signal.signal(s, handler)
        return code


def serve(build_service, cfg: CriticJobConfig) -> int:
    """Run the critic job on this rank until it is stopped; returns the process exit code. `build_service()` builds
    this rank's CriticService (on rank 0 while Triton starts)."""
    logging.getLogger("pytriton").setLevel(logging.WARNING)
    channel = CommandChannel(current_device())
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        return CriticServer(cfg, channel).serve(build_service)
    service = build_service()
    # A launcher stops the job by signalling every rank: the others wait for rank 0's OP_STOP (rank 0 stops Triton
    # first), so that all ranks exit 0 and torchrun/mpiexec report a clean stop. A dead rank 0 ends their wait with an
    # error in the broadcast.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: None)
    return run_worker(service, channel)
