"""A critic port taken between the critic's own check and Triton's start is named as a port in use (the launcher
then starts the critic again on other ports), from tritonserver's log: a CI run lost a metrics port that way."""

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
