"""Wait until the critic job answers, or say clearly why it will not (standard library only: runs on the batch host).

    wait_critic.py --url http://HOST:PORT [--pid PID] [--log FILE [--ready-line TEXT]] [--timeout S]
    wait_critic.py --address-file FILE [--job-id ID] [--resolved OUT] [--log FILE] [--timeout S]

Ready means GET <url>/v2/health/ready answers 200 (Triton's health endpoint), and with --ready-line that --log holds
that text too: Triton's health answers as soon as tritonserver runs, before the critic's endpoints are loaded, and
a tritonserver that aborts while it loads them (the python backend's intermittent
boost::interprocess::lock_exception, seen in CI) would otherwise take the critic down after its actor started; the
critic server prints its ready line once every endpoint answered.
With --address-file, the critic job's address is read from FILE (`HOST PORT JOBID`, written by critic.sbatch once it
is ready); with --job-id, a file from another critic job is ignored, and the wait fails as soon as that job is no
longer in the queue. `--resolved OUT` receives `HOST PORT` once ready.

Exit status: 0 ready; 3 the critic (process --pid or job --job-id) ended before it was ready; 4 time limit reached.
The last lines of --log are printed with a failure.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import urllib.request

DEAD, TIMEOUT = 3, 4


def pid_alive(pid: int) -> bool:
    """False once the process has exited (a zombie not yet reaped by its parent counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def job_alive(job_id: str) -> bool:
    """True while Slurm still lists the job (pending, running or completing); True if squeue cannot say."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return True
    if out.returncode != 0:
        return "Invalid job id" not in out.stderr
    states = out.stdout.split()
    return bool(states) and not all(s in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") for s in states)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def read_address(path: str, job_id: str | None) -> tuple[str, int] | None:
    try:
        with open(path) as f:
            fields = f.read().split()
    except OSError:
        return None
    if len(fields) < 2 or (job_id and (len(fields) < 3 or fields[2] != job_id)):
        return None  # not written yet, or left by another critic job
    return fields[0], int(fields[1])


def holds(path: str | None, text: str) -> bool:
    try:
        with open(path, errors="replace") as f:
            return text in f.read()
    except (OSError, TypeError):
        return False


def tail(path: str | None, lines: int = 40) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            return f"--- last lines of {path} ---\n" + "".join(f.readlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url")
    where.add_argument("--address-file")
    p.add_argument("--pid", type=int, help="the critic's process (its srun); its end means failure")
    p.add_argument("--job-id", help="the critic's Slurm job; its end means failure")
    p.add_argument("--log", help="the critic's log, printed on failure")
    p.add_argument("--ready-line", help="ready only once --log holds this text as well")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--resolved", help="write `HOST PORT` here once ready")
    p.add_argument("--interval", type=float, default=1.0)
    args = p.parse_args(argv)
    if args.ready_line and not args.log:
        p.error("--ready-line needs --log (the file that must hold it)")

    start = time.monotonic()
    url, host_port = args.url, None
    while True:
        if url is None:
            host_port = read_address(args.address_file, args.job_id)
            url = f"http://{host_port[0]}:{host_port[1]}" if host_port else None
        if url is not None and answers(url) and (not args.ready_line or holds(args.log, args.ready_line)):
            break
        if args.pid is not None and not pid_alive(args.pid):
            print(
                f"wait_critic: the critic job step ended before it answered at {url}\n{tail(args.log)}",
                file=sys.stderr,
                flush=True,
            )
            return DEAD
        if args.job_id is not None and not job_alive(args.job_id):
            print(
                f"wait_critic: critic job {args.job_id} ended before it answered"
                f"{' at ' + url if url else ''}\n{tail(args.log)}",
                file=sys.stderr,
                flush=True,
            )
            return DEAD
        if time.monotonic() - start > args.timeout:
            what = url or f"the address in {args.address_file} (not written by the critic job yet)"
            print(
                f"wait_critic: the critic did not answer at {what} within {args.timeout:.0f} s. It may still be "
                f"loading (raise the wait with CRITIC_READY_TIMEOUT=seconds) or be stuck: check its log.\n"
                f"{tail(args.log)}",
                file=sys.stderr,
                flush=True,
            )
            return TIMEOUT
        time.sleep(args.interval)
    if args.resolved:
        if host_port is None:
            rest = url.split("://", 1)[-1]
            host_port = (rest.rsplit(":", 1)[0], int(rest.rsplit(":", 1)[1]))
        tmp = f"{args.resolved}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{host_port[0]} {host_port[1]}\n")
        os.replace(tmp, args.resolved)
    print(f"wait_critic: critic ready at {url} after {time.monotonic() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
