"""A throw-away Slurm cluster on this machine, for tests and CI (root, no systemd needed).

    cluster = SlurmCluster(nodes=3).start()     # munged + slurmctld + one slurmd per virtual node, ~1 s
    subprocess.run(["sbatch", "--wait", ...], env=cluster.env())
    cluster.stop()                              # cancels what is left, stops every daemon it started

    python tests/slurm/slurm_cluster.py up [--nodes N] [--dir D]   # by hand: prints `export SLURM_CONF=...`
    python tests/slurm/slurm_cluster.py down --dir D

Everything is private to one directory: its own munge key and munged socket (`AuthInfo=socket=...`), its own
slurm.conf (clients find it through `SLURM_CONF`, which `env()` sets), free ports for slurmctld and each slurmd, so
it neither reads nor disturbs /etc/slurm, /etc/munge or another cluster on the machine. Virtual nodes `n1..nN` all
run on localhost (`NodeHostname=localhost NodeAddr=127.0.0.1`): heterogeneous jobs need one node per component.
Only the backfill scheduler starts heterogeneous jobs, so it runs every second (`bf_interval=1,bf_hetjob_immediate`).

Daemons run in the foreground as children of this process (`-D`/`-F`), so stopping them needs no pid files.
Debian's packages are installed if missing (`ensure_installed`, root only); `SlurmUnavailable` says why not.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "sinfo", "munged"]


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed and not installable); the message says why."""


def _missing() -> list[str]:
    search = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=search) is None]


def ensure_installed() -> None:
    """Install Debian's Slurm and munge packages unless present; raise SlurmUnavailable if that is impossible."""
    if not _missing():
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(
            f"{', '.join(_missing())} not installed and not root: run `apt-get install -y {' '.join(PACKAGES)}` as root"
        )
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(_missing())} not installed and there is no apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES],
    ):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SlurmUnavailable(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    if _missing():
        raise SlurmUnavailable(f"still missing after apt-get install: {', '.join(_missing())}")


def _free_ports(n: int) -> list[int]:
    """n distinct free TCP ports for the daemons, from aligner's pool outside the kernel's ephemeral range, where no
    outgoing connection can take one before the daemon binds it (aligner/utils/net.py); a process never draws a port
    twice within two minutes, so they differ."""
    from aligner.utils.net import free_port_range

    return [free_port_range(1) for _ in range(n)]


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


class SlurmCluster:
    """munged + slurmctld + `nodes` slurmd on localhost, all configured under `root` (a new temp dir by default)."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 4, root: str | None = None):
        self._own_root = root is None
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster runs its daemons as root (SlurmUser=root); run as root")
        self.nodes, self.cpus = nodes, cpus_per_node
        self.root = root or tempfile.mkdtemp(prefix="aligner-slurm-")
        self.conf = os.path.join(self.root, "slurm.conf")
        self.socket = os.path.join(self.root, "munge", "munge.socket")
        self._procs: list[subprocess.Popen] = []

    # -- configuration ------------------------------------------------------------------------------------
    def write_config(self) -> None:
        d = self.root
        for sub in ("munge", "ctld", "log", "spool"):
            os.makedirs(os.path.join(d, sub), mode=0o700, exist_ok=True)
        key = os.path.join(d, "munge", "munge.key")
        if not os.path.exists(key):
            with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(os.urandom(1024))
        ctld_port, *node_ports = _free_ports(1 + self.nodes)
        lines = [
            "ClusterName=alignerci",
            # Job ids seed the launchers' default ports: a random start keeps two clusters on one machine apart.
            f"FirstJobId={random.randrange(1000, 4_000_000)}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={d}/ctld",
            f"SlurmdSpoolDir={d}/spool/%n",
            f"SlurmctldPidFile={d}/slurmctld.pid",
            f"SlurmdPidFile={d}/slurmd-%n.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log",
            f"SlurmdLogFile={d}/log/slurmd-%n.log",
            f"PlugStackConfig={d}/plugstack.conf",  # not /etc/slurm's (pyxis or other SPANK plugins may live there)
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",  # more CPUs per virtual node than the machine has cores
            "MpiDefault=none",
            "SwitchType=switch/none",
            "ReturnToService=2",
            "KillWait=10",  # SIGTERM -> SIGKILL grace at a time limit or scancel
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,bf_hetjob_immediate",  # het jobs start only from backfill
            "MailProg=/bin/true",
        ]
        for i, port in enumerate(node_ports, start=1):
            lines.append(
                f"NodeName=n{i} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                f"RealMemory=2000 State=UNKNOWN"
            )
        lines.append(
            f"PartitionName=debug Nodes=n[1-{self.nodes}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
        )
        open(os.path.join(d, "plugstack.conf"), "w").close()
        tmp = self.conf + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, self.conf)

    def env(self, base: dict | None = None) -> dict:
        """The environment for Slurm clients (sbatch, srun, squeue, ...) talking to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        for k in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            del env[k]  # a test run inside a Slurm job must not leak that job's ids into the jobs it submits
        return env

    # -- lifecycle ----------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(os.path.join(self.root, "log", f"{name}.out"), "ab")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True
        )
        log.close()
        self._procs.append(proc)
        return proc

    def _wait(self, what: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self._procs:
                if p.poll() is not None:
                    raise SlurmUnavailable(
                        f"{p.args[0]} exited with status {p.returncode} while waiting for "
                        f"{what}; logs: {self.root}/log\n{self.logs_tail()}"
                    )
            if ok():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"{what} not reached within {timeout:.0f} s; logs: {self.root}/log\n{self.logs_tail()}")

    def run(
        self, *cmd: str, timeout: float = 30, env: dict | None = None, cwd: str | None = None
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster (wrapped in `timeout`: a client can block for long)."""
        return subprocess.run(
            ["timeout", str(int(timeout)), *cmd],
            env=env or self.env(),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout + 10,
        )

    def start(self, timeout: float = 60) -> "SlurmCluster":
        ensure_installed()
        self.write_config()
        m = os.path.join(self.root, "munge")
        self._spawn(
            "munged",
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.socket}",
                f"--key-file={m}/munge.key",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self._wait("munged's socket", lambda: os.path.exists(self.socket), timeout)
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-f", self.conf])
        self._wait("slurmctld answering", lambda: self.run("scontrol", "ping").stdout.count("UP") > 0, timeout)
        for i in range(1, self.nodes + 1):
            self._spawn(f"slurmd-n{i}", [_sbin("slurmd"), "-D", "-N", f"n{i}", "-f", self.conf])
        self._wait(f"{self.nodes} idle nodes", self._all_idle, timeout)
        return self

    def _all_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        return len(out) == 2 * self.nodes and set(out[1::2]) == {"idle"}

    def jobs(self) -> list[str]:
        """Ids of the jobs still queued, running or completing (a heterogeneous job by its leader's id)."""
        ids = self.run("squeue", "-h", "-o", "%i").stdout.split()
        return sorted({i.split("+")[0] for i in ids})

    def stop(self, timeout: float = 30, remove: bool = False) -> None:
        """Cancel every job, wait for them to end, then stop the daemons (SIGTERM, then SIGKILL); `remove` deletes
        the state directory if this object made it."""
        try:
            if self._procs and all(p.poll() is None for p in self._procs):
                self.run("scancel", "--full", "--user=root")
                deadline = time.monotonic() + timeout
                while self.jobs() and time.monotonic() < deadline:
                    time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for p in reversed(self._procs):  # slurmd first, munged last: they need it to say goodbye
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self._procs.clear()
        if remove and self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def logs_tail(self, lines: int = 15) -> str:
        out = []
        for name in sorted(os.listdir(os.path.join(self.root, "log"))):
            with open(os.path.join(self.root, "log", name), errors="replace") as f:
                tail = f.readlines()[-lines:]
            if tail:
                out.append(f"--- {name} ---\n{''.join(tail)}")
        return "\n".join(out)

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Start or stop a private Slurm test cluster on localhost.")
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--dir", default=None, help="state directory (up: default a new temp dir; down: required)")
    args = p.parse_args(argv)
    if args.action == "up":
        cluster = SlurmCluster(args.nodes, root=args.dir).start()
        for proc in cluster._procs:  # leave the daemons running after this process exits
            proc.returncode = 0
        print(f"export SLURM_CONF={cluster.conf}  # stop with: {sys.argv[0]} down --dir {cluster.root}")
        return 0
    if not args.dir:
        p.error("down needs --dir")
    conf = os.path.join(args.dir, "slurm.conf")
    subprocess.run(
        ["timeout", "30", "scancel", "--full", "--user=root"],
        env={**os.environ, "SLURM_CONF": conf},
        capture_output=True,
    )
    for pattern in ("slurmd-n*.pid", "slurmctld.pid", "munge/munged.pid"):  # daemons first, munged last
        for path in glob.glob(os.path.join(args.dir, pattern)):
            try:
                with open(path) as f:
                    os.kill(int(f.read().split()[0]), signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                pass
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
