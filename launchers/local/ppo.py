"""Run PPO on one machine: start the critic job and the actor job together, run until the actor is done, stop the
critic.

    python launchers/local/ppo.py [--actor-procs N] [--critic-procs M] [--launcher torchrun|mpiexec]
                                  [--actor-gpus LIST] [--critic-gpus LIST] [--actor-only]
                                  [--actor-config NAME] [--critic-config NAME] [--exp-dir DIR] [--port P]
                                  [--actor KEY=VALUE ...] [--critic KEY=VALUE ...]

--actor-only runs the actor job alone, for configs whose reward needs no critic job (reward.source=function with
a critic-free estimator; launchers/local/grpo.sh); the --critic* options are then ignored, and everything below
holds for the actor job alone.

On a machine with several GPUs, --actor-gpus 0,1 --critic-gpus 2 gives each job its own devices
(CUDA_VISIBLE_DEVICES per job; each rank takes the GPU of its local rank among them). Without them both jobs see
every GPU the launcher sees, and the ranks of each job start at GPU 0. Where every GPU of the actor's ranks also runs
a critic rank, or no GPU is visible (both jobs on the CPU), the actor is started with critic.overlap=false (it waits
for the critic's answers before its own work, so that the two jobs take turns instead of time-slicing the GPU or
competing for the cores); an explicit --actor critic.overlap=... wins.

With no arguments: the CPU demo (conf/ppo_actor_demo.yaml + conf/ppo_critic_demo.yaml). More than one process per job
uses torchrun (gloo on CPU, NCCL on GPU), or `mpiexec -n N` with --launcher mpiexec (the mpich wheel's, or the
MPI on PATH; ranks read PMI_*/OMPI_* and meet at MASTER_ADDR:MASTER_PORT, set per job). The critic's output goes to
<exp-dir>/critic.log (its tail is printed if it fails). Exit status: the actor's if it failed, else the critic's if it
failed, else 0; no process is left behind, also when this launcher is killed (the jobs get SIGTERM when it dies).
The last line printed is `metrics: <path of metrics.jsonl>`. Restarting the same command resumes both jobs from the
run's newest committed checkpoint. One launcher per experiment directory: a second one stops at once (exit 2).
The jobs share a secret generated per run (ALIGNER_CRITIC_TOKEN, in their environment, not on a command line). If
the critic's ports are taken between their choice and Triton's start, both jobs are started again, the critic on other
ports (3 tries). The actor starts with the critic (its imports and model build overlap the critic's start-up) and
waits for the critic's endpoints itself (critic.start_timeout, set to --ready-timeout unless given).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from aligner.critic.auth import TOKEN_ENV, new_token  # noqa: E402  (no torch)
from aligner.utils.lock import LockError, hold  # noqa: E402  (no torch)
from aligner.utils.net import free_port_range, port_slice  # noqa: E402  (no torch)

READY_LINE = "critic server ready at"
PORT_TRIES = 3
CRITIC_STOP_GRACE = 120.0  # seconds for the critic to unload its endpoints and stop Triton (a loaded host is slow)


def _die_with_parent() -> None:
    """In a job's top process (between fork and exec): SIGTERM it when this launcher dies, however it dies (Linux:
    PR_SET_PDEATHSIG), so a killed launcher never leaves the jobs (and tritonserver) running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def mpiexec_path() -> str:
    """The mpiexec beside this interpreter (pip's mpich wheel) if there is one, else the first on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.path.exists(here) else shutil.which("mpiexec")
    if found is None:
        raise SystemExit(
            "--launcher mpiexec: no mpiexec found; pip install -e '.[mpi]' (the mpich wheel) or load an MPI module"
        )
    return found


def command(script: str, procs: int, config: str, overrides: list[str], launcher: str = "torchrun") -> list[str]:
    if procs > 1 and launcher == "mpiexec":
        # `env` gives this job its own rendezvous port without touching the other job's environment.
        head = [
            "env",
            "MASTER_ADDR=127.0.0.1",
            f"MASTER_PORT={free_port_range(1)}",
            mpiexec_path(),
            "-n",
            str(procs),
            sys.executable,
        ]
    elif procs > 1:
        head = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(procs),
            "--master-port",
            str(free_port_range(1)),
        ]
    else:
        head = [sys.executable]
    return head + [os.path.join(ROOT, "scripts", script), "--config-name", config] + overrides


# What every job this launcher and launchers/local/train.py start gets unless the caller's environment sets it (the
# defaults of launchers/slurm/env.sh). The allocator's expandable segments: fewer fragmentation OOMs where rollout and
# training shapes alternate, and where both PPO jobs share a GPU (one H100: the critic at 4 / 8 rows a micro-batch ran
# out of memory without them and fit with them; at 16 / 32 the peak went 84.7 -> 81.0 GB; docs/PERF.md).
JOB_ENV_DEFAULTS = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def job_env(environ=os.environ) -> dict:
    """The environment jobs start with: the caller's, over JOB_ENV_DEFAULTS, with unbuffered Python output."""
    return {**JOB_ENV_DEFAULTS, **environ, "PYTHONUNBUFFERED": "1"}


def gpu_env(gpus: str | None, procs: int, flag: str) -> dict:
    """CUDA_VISIBLE_DEVICES for one job ({} when `gpus` is None); ValueError naming `flag` for a bad list."""
    if gpus is None:
        return {}
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{flag} {gpus!r}: give distinct GPU indices separated by commas, e.g. {flag} 0,1")
    if len(ids) < procs:
        raise ValueError(f"{flag} {gpus!r} names {len(ids)} GPU(s) for {procs} process(es): one GPU per process")
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}


def _gpu_ids(env: dict) -> list[str]:
    """The GPU list of a gpu_env() result ([] when none was given)."""
    return [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]


def sharing_note(actor_env: dict, critic_env: dict) -> str | None:
    """A note when the two jobs' GPU lists (gpu_env's) overlap; None when they do not or are not given."""
    actor, critic = _gpu_ids(actor_env), _gpu_ids(critic_env)
    shared = sorted(set(actor) & set(critic), key=actor.index)
    if not shared:
        return None
    note = f"the actor and critic jobs share GPU(s) {','.join(shared)}"
    if len(shared) < len(actor):  # measured on 2x H200: the shared GPU's rank ran its GEMMs 31-36 % slower
        note += (
            f"; the actor's ranks on GPU(s) {','.join(g for g in actor if g not in shared)} will wait for the ranks"
            " on the shared ones in every collective (give the critic GPUs of its own, or spread it over all of the"
            " actor's: docs/PPO.md)"
        )
    return note


def visible_gpus(environ=os.environ) -> list[str]:
    """The GPUs a job started without a list sees: CUDA_VISIBLE_DEVICES's, else `nvidia-smi -L`'s ([] without)."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def _ranks_gpus(env: dict, procs: int, visible: list[str]) -> list[str]:
    """The GPUs of a job's ranks: each takes the GPU of its local rank in its list (gpu_env's), or among `visible`."""
    return (_gpu_ids(env) if env else visible)[:procs]


def turn_taking(actor_env: dict, actor_procs: int, critic_env: dict, critic_procs: int, visible: list[str]) -> str:
    """Where the two jobs should take turns (critic.overlap=false), or "" where they should overlap: every GPU of
    the actor's ranks also runs a critic rank, or there is no GPU (both jobs on the CPU). Where only some of the
    actor's GPUs are shared the jobs overlap (8B on 2x H200 with the critic on one of the actor's two GPUs: 13.14 s
    overlapping, 13.24 s taking turns; docs/PERF.md; sharing_note says what to do)."""
    if not visible and not actor_env and not critic_env:
        return "the CPU"
    actor = _ranks_gpus(actor_env, actor_procs, visible)
    critic = set(_ranks_gpus(critic_env, critic_procs, visible))
    return f"GPU(s) {','.join(actor)}" if actor and critic.issuperset(actor) else ""


def idle_gpus_note(actor_env: dict, actor_procs: int, critic_env: dict, critic_procs: int, visible: list[str]):
    """A note naming the visible GPUs that no rank of either job uses (None when every one is used); critic_procs 0:
    no critic job (--actor-only)."""
    used = set(_ranks_gpus(actor_env, actor_procs, visible)) | set(_ranks_gpus(critic_env, critic_procs, visible))
    idle = [g for g in visible if g not in used]
    if not idle:
        return None
    n = len(visible)
    if critic_procs == 0:
        spread = f"--actor-procs {n} spreads the actor over the {n} GPUs"
    else:  # measured on 2x H200 (docs/PERF.md, eleventh session): 1B PPO 5.0 s per step against 5.9 s split
        spread = f"--actor-procs {n} --critic-procs {n} spreads both jobs over the {n} GPUs (the fastest placement"
        spread += " measured on two H200s: docs/LAUNCH.md)"
    return f"no rank of either job runs on GPU(s) {','.join(idle)} of the {n} visible; {spread}"


def signal_job(proc: subprocess.Popen, sig: int) -> None:
    """Send `sig` to a job's own processes. A job of several ranks runs under torchrun or mpiexec (the process-group
    leader): signalling that parent makes it kill its ranks and exit 1, so the ranks themselves get the signal (they
    checkpoint or stop cleanly and exit 0, and so does their parent). A one-process job is the leader itself."""
    import psutil

    ranks = []
    if getattr(proc, "aligner_has_launcher", False):
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                if proc.aligner_script in " ".join(child.cmdline()):  # not tritonserver or helper processes
                    ranks.append(child.pid)
        except psutil.Error:
            pass
    for pid in ranks or [proc.pid]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop(proc: subprocess.Popen | None, grace: float = 30.0) -> None:
    """SIGTERM the job (its ranks, see signal_job), then SIGKILL its whole process group after `grace` seconds."""
    if proc is None or proc.poll() is not None:
        return
    signal_job(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class CriticStartError(RuntimeError):
    def __init__(self, message: str, port_taken: bool, triton_crashed: bool = False):
        super().__init__(message)
        self.port_taken = port_taken
        self.triton_crashed = triton_crashed


def triton_crashed_at_start(log_text: str) -> bool:
    """The critic's Triton aborted while it started (a signal, e.g. the python backend's intermittent
    boost::interprocess::lock_exception, triton-inference-server/server#8882): nothing was served yet, so starting
    the critic job again is safe; a cause that stays fails again."""
    return "Triton failed to start" in log_text and "Signal (" in log_text


def wait_ready(
    url: str,
    proc: subprocess.Popen,
    timeout: float,
    log_path: str,
    log_offset: int,
    actor: subprocess.Popen | None = None,
) -> None:
    """Until the critic job printed its ready line (after it checked all its ports and endpoints) and answers, or
    the actor job (started with it) has ended: the caller then reports the actor's status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if actor is not None and actor.poll() is not None:
            return
        new = _read_from(log_path, log_offset)
        if proc.poll() is not None:
            taken = "already in use" in new or "Address in use" in new
            message = f"the critic job exited with status {proc.returncode} before it was ready"
            raise CriticStartError(message, taken, triton_crashed_at_start(new))
        if READY_LINE in new:
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
        time.sleep(0.5)
    raise CriticStartError(f"the critic job did not answer at {url} within {timeout:.0f} s", False)


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--actor-config", default="ppo_actor_demo")
    p.add_argument("--critic-config", default="ppo_critic_demo")
    p.add_argument("--actor-only", action="store_true", help="no critic job (reward.source=function)")
    p.add_argument("--actor-procs", type=int, default=1)
    p.add_argument("--critic-procs", type=int, default=1)
    p.add_argument(
        "--launcher",
        choices=["torchrun", "mpiexec"],
        default="torchrun",
        help="how jobs of more than one process are started",
    )
    p.add_argument("--actor-gpus", default=None, metavar="LIST", help="GPU indices for the actor job, e.g. 0,1")
    p.add_argument("--critic-gpus", default=None, metavar="LIST", help="GPU indices for the critic job, e.g. 2")
    p.add_argument("--exp-dir", default=os.path.join("results", "demo"))
    p.add_argument("--port", type=int, default=None, help="critic HTTP port (default: a free one)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--actor", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--critic", nargs="*", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        actor_gpus = gpu_env(args.actor_gpus, args.actor_procs, "--actor-gpus")
        critic_gpus = gpu_env(args.critic_gpus, args.critic_procs, "--critic-gpus")
        port_slice()  # ALIGNER_PORT_SLICE, read by every port drawn below
    except ValueError as exc:
        p.error(str(exc))
    visible = visible_gpus()
    for note in (
        sharing_note(actor_gpus, critic_gpus),
        idle_gpus_note(actor_gpus, args.actor_procs, critic_gpus, 0 if args.actor_only else args.critic_procs, visible),
    ):
        if note:
            print(f"[ppo] note: {note}", flush=True)
    # Two jobs on one GPU time-slice it, two jobs on the CPU compete for its cores: the actor waits for the critic's
    # answers before its own work, so that they take turns (critic.overlap=false; one H200: PPO step 10.06 -> 9.51 s,
    # the CPU demo on 2 cores: 0.35 -> 0.27 s; docs/PERF.md).
    take_turns = []
    if not args.actor_only and not any(o.startswith("critic.overlap=") for o in args.actor):
        where = turn_taking(actor_gpus, args.actor_procs, critic_gpus, args.critic_procs, visible)
        if where:
            take_turns = ["critic.overlap=false"]
            print(f"[ppo] the jobs share {where}: they take turns (critic.overlap=false)", flush=True)

    exp = os.path.abspath(args.exp_dir)
    try:
        lock = hold(exp, "launchers/local/ppo.py")  # noqa: F841 - held until this launcher ends
    except LockError as exc:
        print(f"[ppo] {exc}", file=sys.stderr)
        return 2
    critic_log = os.path.join(exp, "critic.log")
    critic = actor = None
    interrupted = []

    def on_signal(signum, frame):
        interrupted.append(signum)
        if actor is not None and actor.poll() is None:
            signal_job(actor, signal.SIGTERM)  # the actor checkpoints and exits; the critic is stopped after

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    env = {**job_env(), TOKEN_ENV: os.environ.get(TOKEN_ENV) or new_token()}

    def start_actor(overrides: list[str], what: str) -> subprocess.Popen:
        actor_cmd = command(
            "train_ppo_actor.py",
            args.actor_procs,
            args.actor_config,
            [*overrides, *take_turns, f"exp_dir={exp}/actor", *args.actor],
            args.launcher,
        )
        print(f"[ppo] {what}: {' '.join(actor_cmd)}", flush=True)
        actor_env = {**env, **actor_gpus, "ALIGNER_NO_METRICS_LINE": "1"}  # this launcher prints the metrics line
        proc = subprocess.Popen(actor_cmd, cwd=ROOT, env=actor_env, start_new_session=True, preexec_fn=_die_with_parent)
        proc.aligner_has_launcher, proc.aligner_script = args.actor_procs > 1, "train_ppo_actor.py"
        return proc

    # The actor starts with the critic: its first wait for the critic's endpoints lasts as long as this launcher's.
    first_wait = [f"critic.start_timeout={args.ready_timeout:g}"]
    if any(o.startswith("critic.start_timeout=") for o in args.actor):
        first_wait = []
    try:
        if not args.actor_only:
            crashed_once = False
            for attempt in range(1, PORT_TRIES + 1):
                port = args.port or free_port_range(3)
                url = f"http://127.0.0.1:{port}"
                critic_cmd = command(
                    "serve_ppo_critic.py",
                    args.critic_procs,
                    args.critic_config,
                    [f"server.port={port}", "server.host=127.0.0.1", f"exp_dir={exp}/critic", *args.critic],
                    args.launcher,
                )
                print(f"[ppo] critic job: {' '.join(critic_cmd)}\n[ppo] critic log: {critic_log}", flush=True)
                offset = os.path.getsize(critic_log) if os.path.exists(critic_log) else 0
                with open(critic_log, "ab") as logf:
                    critic = subprocess.Popen(
                        critic_cmd,
                        cwd=ROOT,
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        env={**env, **critic_gpus},
                        start_new_session=True,
                        preexec_fn=_die_with_parent,
                    )
                critic.aligner_has_launcher, critic.aligner_script = args.critic_procs > 1, "serve_ppo_critic.py"
                actor = start_actor([f"critic.port={port}", "critic.host=127.0.0.1", *first_wait], "actor job")
                try:
                    wait_ready(url, critic, args.ready_timeout, critic_log, offset, actor)
                    break
                except CriticStartError as exc:
                    stop(actor)
                    actor = None
                    stop(critic, grace=CRITIC_STOP_GRACE)
                    new_ports = exc.port_taken and args.port is None
                    crashed = exc.triton_crashed and not crashed_once
                    retry = (new_ports or crashed) and attempt < PORT_TRIES and not interrupted
                    print(f"[ppo] {exc}\n--- last lines of {critic_log} ---\n{tail(critic_log)}", file=sys.stderr)
                    if not retry:
                        return 1
                    if new_ports:
                        print("[ppo] a port was taken before the critic bound it: retrying on other ports", flush=True)
                    else:
                        crashed_once = True
                        print("[ppo] Triton aborted while the critic started: starting it once more", flush=True)
            if actor.poll() is None:
                print(f"[ppo] critic ready at {url}", flush=True)
        else:
            actor = start_actor([], "actor job (no critic job)")
        while actor.poll() is None:
            if critic is not None and critic.poll() is not None:
                print(
                    f"[ppo] the critic job died (status {critic.returncode}); stopping the actor\n"
                    f"--- last lines of {critic_log} ---\n{tail(critic_log)}",
                    file=sys.stderr,
                )
                stop(actor)
                return critic.returncode or 1
            try:
                actor.wait(timeout=0.5)  # returns as the actor ends (the critic is stopped at once after it)
            except subprocess.TimeoutExpired:
                pass
        actor_rc = actor.returncode
    finally:
        stop(actor)
        stop(critic, grace=CRITIC_STOP_GRACE)
    critic_rc = critic.returncode if critic is not None else 0
    metrics = os.path.join(exp, "actor", "metrics.jsonl")
    if actor_rc != 0:
        print(f"[ppo] the actor job failed (status {actor_rc})", file=sys.stderr)
        return actor_rc
    if critic_rc not in (0, -signal.SIGTERM):
        print(f"[ppo] the critic job failed (status {critic_rc})\n{tail(critic_log)}", file=sys.stderr)
        return critic_rc
    print(f"metrics: {metrics}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
