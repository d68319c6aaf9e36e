"""aligner.critic.server.end_processes: the critic job ends only after its Triton python stubs (and their helpers)
have gone, ending those that do not go by themselves."""

import subprocess
import sys
import time

import psutil

from aligner.critic.server import _with_descendants, end_processes

QUICK = "import time; time.sleep(0.5)"
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
PARENT = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
    "print('ready', flush=True); time.sleep(60)"
)


def _start(code):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return proc


def test_exiting_processes_are_waited_for_and_the_rest_ended():
    quick, deaf = _start(QUICK), _start(DEAF)
    assert deaf.stdout.readline().strip() == "ready"  # its SIGTERM handler is in place
    t0 = time.monotonic()
    forced = end_processes([psutil.Process(quick.pid), psutil.Process(deaf.pid)], timeout=1.0, grace=0.5)
    assert [p.pid for p in forced] == [deaf.pid], "the one that exits by itself is only waited for"
    # psutil reaped both (they are this process's children): their exit codes are on its objects
    assert forced[0].returncode == -9, "SIGTERM ignored: SIGKILL"
    assert not psutil.pid_exists(quick.pid) and not psutil.pid_exists(deaf.pid)
    assert time.monotonic() - t0 < 15


def test_a_stubs_children_are_ended_with_it():
    parent = _start(PARENT)
    assert parent.stdout.readline().strip() == "ready"
    tree = _with_descendants([psutil.Process(parent.pid)])
    assert len(tree) == 2
    child = tree[1]
    assert {p.pid for p in end_processes(tree, timeout=0.5)} == {p.pid for p in tree}
    assert not child.is_running() and not psutil.pid_exists(parent.pid)
    assert end_processes([], timeout=0.1) == []


def test_stubs_of_this_servers_workspace_are_found_after_tritonserver_has_gone(tmp_path):
    """A stub whose tritonserver died first is a child of init: found by the workspace it runs from (and only by
    this server's: another workspace whose name starts the same is not)."""
    from aligner.critic.server import _python_stubs

    orphan = "import subprocess as s, sys; print(s.Popen(sys.argv[1:], stdout=s.DEVNULL, stderr=s.DEVNULL).pid)"
    pids = {}
    for name in ("critic_ab", "critic_abc"):
        folder = tmp_path / name / "w" / "tritonserver" / "backends" / "python"
        folder.mkdir(parents=True)
        stub = folder / "triton_python_backend_stub"
        stub.write_text("#!/bin/sh\nsleep 60\n")
        stub.chmod(0o755)
        # started by a process that exits at once (and is reaped here): the stub's parent is init (or a subreaper)
        run = subprocess.run([sys.executable, "-c", orphan, str(stub), "/tmp/model.py"], capture_output=True, text=True)
        pids[name] = int(run.stdout)
    try:
        assert psutil.Process(pids["critic_ab"]).ppid() != psutil.Process().pid
        for name, pid in pids.items():  # (until the stub's shell has read its script: it is named by it from exec)
            deadline = time.monotonic() + 10
            while [p.pid for p in _python_stubs(str(tmp_path / name))] != [pid] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert [p.pid for p in _python_stubs(str(tmp_path / name))] == [pid]
        assert _python_stubs() == [], "without a workspace: this process's own descendants only"
    finally:
        for pid in pids.values():
            tree = _with_descendants([psutil.Process(pid)])
            end_processes(tree, timeout=0.1, grace=2.0)
            assert not any(p.is_running() for p in tree)
