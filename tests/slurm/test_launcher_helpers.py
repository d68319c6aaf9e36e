"""The Slurm launchers' pieces that need no cluster: shell syntax, argument parsing, the two-job command lines, and
launchers/slurm/wait_critic.py (ready, critic died first with its log shown, time limit, address file of the right
job only)."""

import http.server
import os
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM = os.path.join(ROOT, "launchers", "slurm")
WAIT = os.path.join(SLURM, "wait_critic.py")


@pytest.mark.parametrize("name", ["ppo.sbatch", "critic.sbatch", "actor.sbatch", "common.sh", "env.sh", "two_jobs.sh"])
def test_shell_syntax(name):
    proc = subprocess.run(["bash", "-n", os.path.join(SLURM, name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_signal_lines_in_the_sbatch_files():
    """The time-limit warning goes to the batch script (B:), which orders the shutdown: actor first, then critic."""
    for name in ("ppo.sbatch", "critic.sbatch", "actor.sbatch"):
        with open(os.path.join(SLURM, name)) as f:
            directives = [line for line in f if line.startswith("#SBATCH")]
        assert any(line.split()[1].startswith("--signal=B:TERM@") for line in directives), name
    with open(os.path.join(SLURM, "ppo.sbatch")) as f:
        directives = [line.strip() for line in f if line.startswith("#SBATCH")]
    assert "#SBATCH hetjob" in directives
    assert directives.index("#SBATCH hetjob") > [i for i, d in enumerate(directives) if "--signal" in d][0], (
        "--signal belongs to component 0, whose batch script receives it"
    )


def _parse(*args, env=None):
    script = (
        f'. "{SLURM}/common.sh"; aligner_parse_args "$@" || exit $?; '
        'printf "A=%s\\n" "${ACTOR_ARGS[@]}"; printf "C=%s\\n" "${CRITIC_ARGS[@]}"; '
        'echo "ACONF=$ACTOR_CONFIG CCONF=$CRITIC_CONFIG EXP=$EXP_DIR ADDR=$CRITIC_ADDRESS"'
    )
    return subprocess.run(
        ["bash", "-c", script, "parse", *args], capture_output=True, text=True, env={**os.environ, **(env or {})}
    )


def test_argument_parsing():
    proc = _parse(
        "--actor-config",
        "a",
        "--exp-dir",
        "/x y",
        "--actor",
        "k=1",
        "s.t=a b",
        "--critic",
        "c=2",
        "--critic-config",
        "cc",
        "--critic-address",
        "h:5",
        env={"ACTOR_OVERRIDES": "e=0 f=1"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [x for x in lines if x.startswith("A=")] == ["A=e=0", "A=f=1", "A=k=1", "A=s.t=a b"]
    assert [x for x in lines if x.startswith("C=")] == ["C=c=2"]
    assert lines[-1] == "ACONF=a CCONF=cc EXP=/x y ADDR=h:5"


@pytest.mark.parametrize(
    "args,message",
    [
        (["k=1"], "does not follow --actor or --critic"),
        (["--bogus"], "unknown option --bogus"),
        (["--actor", "notakeyvalue"], "unexpected argument notakeyvalue"),
    ],
)
def test_argument_errors(args, message):
    proc = _parse(*args)
    assert proc.returncode == 2 and message in proc.stderr


def test_two_jobs_dry_run():
    proc = subprocess.run(
        [
            os.path.join(SLURM, "two_jobs.sh"),
            "--dry-run",
            "--critic-sbatch",
            "-N 1",
            "--actor-sbatch",
            "-N 2 --gpus-per-node=8",
            "--",
            "--exp-dir",
            "e",
            "--actor",
            "a=1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    critic, actor = proc.stdout.splitlines()
    assert critic == f"sbatch --parsable -N 1 {SLURM}/critic.sbatch --exp-dir e --actor a=1"
    assert actor == (
        f"sbatch --parsable --dependency=after:CRITIC_JOB_ID --export=ALL,CRITIC_JOB_ID=CRITIC_JOB_ID "
        f"-N 2 --gpus-per-node=8 {SLURM}/actor.sbatch --exp-dir e --actor a=1"
    )


# -- wait_critic.py ----------------------------------------------------------------------------------------
class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200 if self.path == "/v2/health/ready" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _wait(*args):
    return subprocess.run(
        [sys.executable, WAIT, "--interval", "0.1", *args], capture_output=True, text=True, timeout=60
    )


def test_wait_ready(health_server, tmp_path):
    proc = _wait("--url", f"http://127.0.0.1:{health_server}", "--timeout", "10", "--resolved", str(tmp_path / "r"))
    assert proc.returncode == 0 and "critic ready at" in proc.stdout
    assert (tmp_path / "r").read_text() == f"127.0.0.1 {health_server}\n"


def test_wait_dead_critic_shows_its_log(tmp_path):
    log = tmp_path / "critic.log"
    log.write_text("config error at 'train.epochs': must be >= 1, got 0\n")
    dead = subprocess.Popen(["true"])
    dead.wait()
    proc = _wait("--url", "http://127.0.0.1:9", "--pid", str(dead.pid), "--log", str(log), "--timeout", "30")
    assert proc.returncode == 3
    assert "ended before it answered" in proc.stderr and "config error at 'train.epochs'" in proc.stderr


def test_wait_time_limit_is_explained():
    proc = _wait("--url", "http://127.0.0.1:9", "--timeout", "0.5")
    assert proc.returncode == 4
    assert "did not answer at http://127.0.0.1:9 within 0 s" in proc.stderr and "CRITIC_READY_TIMEOUT" in proc.stderr


def test_wait_address_file_of_the_given_job_only(health_server, tmp_path):
    address = tmp_path / "critic_address"
    address.write_text(f"127.0.0.1 {health_server} 41\n")  # left by another critic job
    proc = _wait("--address-file", str(address), "--job-id", "42", "--timeout", "0.5")
    assert proc.returncode == 4 and "not written by the critic job yet" in proc.stderr
    address.write_text(f"127.0.0.1 {health_server} 42\n")
    proc = _wait("--address-file", str(address), "--job-id", "42", "--timeout", "10", "--resolved", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "r").read_text() == f"127.0.0.1 {health_server}\n"


def test_wait_for_the_critics_ready_line_too(health_server, tmp_path):
    """--ready-line: Triton's health answers as soon as tritonserver runs, before the critic's endpoints are loaded;
    the launchers start the actor only once the critic's log also holds its ready line."""
    log = tmp_path / "critic.log"
    log.write_text("building the value model\n")
    url = f"http://127.0.0.1:{health_server}"
    proc = _wait("--url", url, "--log", str(log), "--ready-line", "critic server ready at", "--timeout", "0.5")
    assert proc.returncode == 4, proc.stdout + proc.stderr
    log.write_text("building the value model\ncritic server ready at http://127.0.0.1:1 (endpoints ...)\n")
    proc = _wait("--url", url, "--log", str(log), "--ready-line", "critic server ready at", "--timeout", "10")
    assert proc.returncode == 0 and "critic ready at" in proc.stdout, proc.stderr
    proc = _wait("--url", url, "--ready-line", "critic server ready at")
    assert proc.returncode == 2 and "--ready-line needs --log" in proc.stderr


def test_a_triton_abort_at_start_is_recognised(tmp_path):
    """common.sh's triton_aborted_at_start: the critic log of a tritonserver that ended on a signal while it started
    (the text of the CI run that saw it) makes the launchers start the critic again; any other failure does not."""
    aborted = (
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
        "  what():  boost::interprocess::lock_exception\nSignal (6) received.\n"
        "critic server failed: Triton failed to start: HTTPConnectionClosed('connection closed.'); see x.log\n"
    )
    other = "critic server failed: Triton failed to start: port 8000 is already in use\n"
    for text, expected in ((aborted, True), (other, False), ("config error at 'train.epochs'\n", False)):
        log = tmp_path / "critic.log"
        log.write_text(text)
        script = f'. "{SLURM}/common.sh"; triton_aborted_at_start "{log}"'
        assert (subprocess.run(["bash", "-c", script]).returncode == 0) == expected, text
    script = f'. "{SLURM}/common.sh"; triton_aborted_at_start "{tmp_path}/missing.log"'
    assert subprocess.run(["bash", "-c", script]).returncode != 0
