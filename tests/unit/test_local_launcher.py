"""launchers/local/ppo.py: per-job GPU lists (--actor-gpus / --critic-gpus) and their errors; the critic start's
port-race verdict; the jobs' environment."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PATH = os.path.join(ROOT, "launchers", "local", "ppo.py")


def _launcher():
    spec = importlib.util.spec_from_file_location("local_ppo_launcher", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_lists_become_each_jobs_visible_devices():
    gpu_env = _launcher().gpu_env
    assert gpu_env(None, 4, "--actor-gpus") == {}
    assert gpu_env("0,1", 2, "--actor-gpus") == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_env(" 4, 5,6 ", 1, "--critic-gpus") == {"CUDA_VISIBLE_DEVICES": "4,5,6"}


def test_jobs_get_expandable_segments_unless_the_caller_chose():
    job_env = _launcher().job_env
    env = job_env({"PATH": "/bin", "PYTHONUNBUFFERED": "0"})
    assert env == {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert job_env({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})["PYTORCH_CUDA_ALLOC_CONF"] == (
        "max_split_size_mb:512"
    )
    slurm = open(os.path.join(ROOT, "launchers", "slurm", "env.sh")).read()  # the same default as the Slurm jobs'
    assert 'PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"' in slurm


def test_a_critic_on_some_of_the_actors_gpus_is_pointed_out():
    launcher = _launcher()
    note, env = launcher.sharing_note, launcher.gpu_env
    assert note(env("0", 1, "a"), env("1", 1, "c")) is None  # GPUs of its own
    assert note({}, env("0", 1, "c")) is None  # the actor sees every GPU: nothing to compare
    assert note(env("0,1", 2, "a"), env("0,1", 2, "c")) == "the actor and critic jobs share GPU(s) 0,1"  # spread
    uneven = note(env("0,1", 2, "a"), env("1", 1, "c"))
    assert uneven.startswith("the actor and critic jobs share GPU(s) 1; the actor's ranks on GPU(s) 0 will wait")


@pytest.mark.parametrize(
    "gpus, procs, text",
    [
        ("0", 2, r"names 1 GPU\(s\) for 2 process\(es\)"),
        ("0,0", 1, "distinct GPU indices"),
        ("a", 1, "distinct GPU indices"),
        ("", 1, "distinct GPU indices"),
    ],
)
def test_bad_gpu_lists_are_named(gpus, procs, text):
    with pytest.raises(ValueError, match=text):
        _launcher().gpu_env(gpus, procs, "--actor-gpus")


def test_bad_gpu_list_stops_the_launcher_before_any_job(tmp_path):
    proc = subprocess.run(
        [sys.executable, PATH, "--exp-dir", str(tmp_path / "exp"), "--critic-gpus", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--critic-gpus 'x'" in proc.stderr
    assert not (tmp_path / "exp").exists(), "nothing started, nothing written"


def test_a_critic_that_lost_a_port_race_is_told_apart(tmp_path):
    """The launcher retries on other ports only when the critic died of a taken port (issue 14), and once more when
    Triton aborted as it started (a CI run saw the python backend's boost::interprocess::lock_exception)."""
    log = tmp_path / "critic.log"
    ppo = _launcher()
    log.write_text("critic server ready at http://old-run\n")  # an earlier run's line does not count
    offset = log.stat().st_size
    crash = (
        "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\nSignal (6) received.\n"
        "critic server failed: Triton failed to start: HTTPConnectionClosed('connection closed.'); see x.log"
    )
    cases = (
        ("port 5 (metrics) on 127.0.0.1 is already in use (Address in use)", True, False),
        ("boom", False, False),
        (crash, False, True),
        ("critic server failed: Triton failed to start: endpoint critic_infer did not answer", False, False),
    )
    for text, taken, crashed in cases:
        with open(log, "a") as f:
            f.write(text + "\n")
        proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
        proc.wait()
        with pytest.raises(ppo.CriticStartError) as info:
            ppo.wait_ready("http://127.0.0.1:9", proc, 10, str(log), offset)
        assert info.value.port_taken is taken and info.value.triton_crashed is crashed
        offset = log.stat().st_size


def test_the_wait_for_the_critic_ends_with_the_actor_started_beside_it(tmp_path):
    """The actor starts with the critic: if it ends first (e.g. a config error, exit 2), the launcher stops waiting
    for the critic at once and reports the actor's status; while the actor runs, a critic that never gets ready is
    still a start error after the timeout."""
    log = tmp_path / "critic.log"
    log.write_text("")
    ppo = _launcher()
    critic = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        actor = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
        actor.wait()
        ppo.wait_ready("http://127.0.0.1:9", critic, 30, str(log), 0, actor)  # returns, no CriticStartError
        assert critic.poll() is None
        running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(ppo.CriticStartError, match="did not answer"):
                ppo.wait_ready("http://127.0.0.1:9", critic, 1, str(log), 0, running)
        finally:
            running.kill()
    finally:
        critic.kill()


def test_jobs_on_one_gpu_are_told_to_take_turns():
    launcher = _launcher()
    turns, env = launcher.turn_taking, launcher.gpu_env
    assert turns(env("0", 1, "a"), 1, env("1", 1, "c"), 1, ["0", "1"]) == ""  # GPUs of their own
    assert turns(env("0", 1, "a"), 1, env("0", 1, "c"), 1, ["0"]) == "GPU(s) 0"
    assert turns({}, 1, {}, 1, ["0"]) == "GPU(s) 0"  # no lists on a one-GPU machine: both jobs start at GPU 0
    assert turns({}, 2, {}, 2, ["0", "1"]) == "GPU(s) 0,1"  # both spread over the same two GPUs
    assert turns({}, 2, env("1", 1, "c"), 1, ["0", "1"]) == ""  # only the actor's GPU 1 shared: they overlap
    assert turns(env("0,1", 2, "a"), 2, env("1", 1, "c"), 1, ["0", "1"]) == ""
    assert turns({}, 1, {}, 1, []) == "the CPU"
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}) == ["2", "3"]
    assert launcher.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_gpus_that_no_rank_uses_are_pointed_out():
    launcher = _launcher()
    idle, env = launcher.idle_gpus_note, launcher.gpu_env
    note = idle({}, 1, {}, 1, ["0", "1"])  # the defaults on a two-GPU machine: both jobs on GPU 0
    assert note.startswith("no rank of either job runs on GPU(s) 1 of the 2 visible;")
    assert "--actor-procs 2 --critic-procs 2 spreads both jobs over the 2 GPUs" in note
    assert idle({}, 2, {}, 2, ["0", "1"]) is None
    assert idle(env("0", 1, "a"), 1, env("1", 1, "c"), 1, ["0", "1"]) is None  # a GPU per job
    assert "GPU(s) 2,3 of the 4" in idle(env("0", 1, "a"), 1, env("1", 1, "c"), 1, ["0", "1", "2", "3"])
    only_actor = idle({}, 1, {}, 0, ["0", "1"])  # --actor-only (GRPO): no critic job
    assert only_actor.endswith("--actor-procs 2 spreads the actor over the 2 GPUs")
    assert idle({}, 1, {}, 1, []) is None  # CPU
