"""A critic port taken between the critic's own check and Triton's start is named as a port in use (the launcher
then starts the critic again on other ports), from tritonserver's log: a CI run lost a metrics port that way. And
the critic's own tritonserver, still exiting after a failed start, is not taken for another program. A start whose
tritonserver copy could not be executed yet ("Text file busy", another CI run) is tried again."""

import errno
import os
import subprocess
import sys

import pytest
from critic_harness import free_ports

from aligner.critic.server import port_taken_line

# the line tritonserver 2.51 wrote in that CI run
TAKEN = (
    'E1201 11:26:40.061355 9649 main.cc:293] "failed to start Metrics service: Unavailable - Socket '
    "'127.0.0.1:46525' already in use \"\n"
)


def test_the_triton_log_line_of_a_taken_port_is_found(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text("I1201 11:26:39.0 9649 server.cc:1] started\n" + TAKEN + "I1201 11:26:40.1 9649 x] exiting\n")
    line = port_taken_line(str(log))
    assert line == "failed to start Metrics service: Unavailable - Socket '127.0.0.1:46525' already in use"
    # the launcher retries on other ports when the critic's error says so (launchers/local/ppo.py wait_ready)
    assert "already in use" in line


def test_no_line_no_log():
    assert port_taken_line(None) is None
    assert port_taken_line("/nonexistent/tritonserver.log") is None


def test_a_log_without_it(tmp_path):
    log = tmp_path / "tritonserver.log"
    log.write_text("I1201 started\nE1201 something else failed\n")
    assert port_taken_line(str(log)) is None


# -- the error of a failed Triton start (server.start_failure), with real processes holding real ports


def _holder(port: int, seconds: float):
    """A process that listens on `port` for `seconds` (as tritonserver holds its ports while it exits)."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('127.0.0.1', {port})); s.listen(); print('bound', flush=True); time.sleep({seconds})\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "bound"
    return proc


def _failure(server, holder, exit_wait=20.0):
    from aligner.critic.server import start_failure

    def death_reason():
        return "tritonserver exited"

    return start_failure(
        TimeoutError("not ready"), server, None, lambda: holder.poll() is None, death_reason, exit_wait=exit_wait
    )


def test_our_exiting_tritonserver_is_not_blamed_on_another_program():
    """A CI run: an endpoint slow to start on a loaded machine made PyTriton give up and stop tritonserver, which
    held its ports a few seconds more while it exited; checked at once, they were reported as taken by another
    program. The ports are checked once it is gone: the error is the start's own."""
    from aligner.config.critic import CriticServerConfig
    from aligner.critic.server import TritonStartError

    server = CriticServerConfig(port=free_ports(3))
    ours = _holder(server.port, 1.5)  # exits on its own, as tritonserver does after its exit timeout
    try:
        err = _failure(server, ours)
    finally:
        ours.kill()
        ours.wait()
    assert isinstance(err, TritonStartError) and "TimeoutError('not ready')" in str(err), err
    still = _holder(server.port, 60)  # one that does not exit in time: still not a port taken by another program
    try:
        err = _failure(server, still, exit_wait=1.0)
    finally:
        still.kill()
        still.wait()
    assert isinstance(err, TritonStartError) and "still ran 1 s later" in str(err), err


def test_a_port_held_by_another_program_is_named():
    from aligner.config.critic import CriticServerConfig
    from aligner.critic.server import PortInUseError

    server = CriticServerConfig(port=free_ports(3))
    other = _holder(server.port + 2, 60)  # the metrics port
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # our tritonserver, already exited
    gone.wait()
    try:
        err = _failure(server, gone)
    finally:
        other.kill()
        other.wait()
    assert isinstance(err, PortInUseError) and f"port {server.port + 2} (metrics)" in str(err), err


def _busy_script(tmp_path):
    """An executable script with a handle to it still open for writing: executing it fails with ETXTBSY (Linux)."""
    script = tmp_path / "run.sh"
    writer = open(script, "w")
    writer.write("#!/bin/sh\nexit 0\n")
    writer.flush()
    os.chmod(script, 0o755)
    return str(script), writer


def test_a_start_that_meets_a_file_still_being_written_is_tried_again(tmp_path):
    """retry_text_file_busy with a real ETXTBSY, through sh as PyTriton starts tritonserver: the first start fails
    ("Text file busy" inside sh's ForkException), the clean-up runs, the second start succeeds."""
    import sh

    from aligner.critic.server import retry_text_file_busy, text_file_busy

    script, writer = _busy_script(tmp_path)
    calls = []

    def start():
        calls.append("start")
        sh.Command(script)()

    def clean_up():
        calls.append("clean_up")
        writer.close()

    with pytest.raises(Exception) as first:  # what the first start meets, on its own
        sh.Command(script)()
    assert text_file_busy(first.value), repr(first.value)
    retry_text_file_busy(start, clean_up, wait_s=0)
    assert calls == ["start", "clean_up", "start"]


def test_other_start_errors_and_the_last_attempt_are_raised(tmp_path):
    from aligner.critic.server import retry_text_file_busy

    calls = []

    def missing():
        calls.append("start")
        raise FileNotFoundError("tritonserver")

    with pytest.raises(FileNotFoundError):
        retry_text_file_busy(missing, lambda: calls.append("clean_up"), wait_s=0)
    assert calls == ["start"]  # not ETXTBSY: at once, no clean-up
    script, writer = _busy_script(tmp_path)
    calls.clear()

    def busy():
        calls.append("start")
        subprocess.run([script], check=True)

    with pytest.raises(OSError) as busy_error:
        retry_text_file_busy(busy, lambda: calls.append("clean_up"), attempts=3, wait_s=0)
    writer.close()
    assert busy_error.value.errno == errno.ETXTBSY and calls == ["start", "clean_up"] * 2 + ["start"]
