"""The CPU demo's critic job as a user starts it (`--config-name ppo_critic_demo`): the reward-function path end to
end, SIGINT on a server started like a background job, and a tritonserver that dies under it."""

import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from critic_harness import REPO, SCRIPT, ServerProcess, free_ports, stub_model_folders, triton_workspaces, wait_gone

from aligner.critic import CriticClient, CriticRequestError


def _demo_reward():
    spec = importlib.util.spec_from_file_location("demo_reward", os.path.join(REPO, "conf", "demo", "reward.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.reward_fn


def _encode(texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(REPO, "conf", "demo", "tokenizer.json"))
    return [tok.encode(t, add_special_tokens=False).ids for t in texts]  # pieces: no <bos>


def _demo_server(tmp_path, **kw) -> ServerProcess:
    port = free_ports(3)
    return ServerProcess(["--config-name", "ppo_critic_demo", f"server.port={port}", f"exp_dir={tmp_path}"], **kw)


def test_demo_reward_function_end_to_end_and_sigint(tmp_path):
    # Started the way a shell starts a background job (SIGINT ignored): the job's own handler must still stop it.
    server = _demo_server(tmp_path, ignore_sigint=True, env={"ALIGNER_CRITIC_TOKEN": "s3cret"})
    try:
        url = server.wait_ready()
        with CriticClient(url, connect_timeout=30) as stranger:  # no secret (issue 14): refused, nothing trained
            with pytest.raises(CriticRequestError, match="unauthorized"):
                stranger.resume_async(None, "a1").result(60)
        wrong = CriticClient(url, connect_timeout=30, token="guess")
        with pytest.raises(CriticRequestError, match="unauthorized"):
            wrong.infer_async(torch.ones(1, 3, dtype=torch.long), torch.tensor([3])).result(60)
        wrong.close()
        prompts, responses, labels = ["say a: cat:", "say a: moon rain:"], ["aaxa", "b a"], ["a", "b"]
        prompt_ids, response_ids = _encode(prompts), _encode(responses)
        rows = [p + r for p, r in zip(prompt_ids, response_ids)]
        width = max(map(len, rows)) + 3
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        lengths = torch.tensor([len(r) for r in rows])
        prompt_lengths = torch.tensor([len(p) for p in prompt_ids])
        reward_fn = _demo_reward()
        with CriticClient(url, connect_timeout=30, token="s3cret") as client:
            values, rewards = client.infer_async(tokens, lengths, prompt_lengths, labels).result(60)
            expect = reward_fn(prompts, responses, labels)
            assert expect == [0.75, 1 / 3]  # the share of the label's letter
            torch.testing.assert_close(rewards[:, 0], torch.tensor(expect))
            assert values.shape == tokens.shape and values[0, : lengths[0]].abs().sum() > 0
            _, whole = client.infer_async(tokens, lengths).result(60)  # no prompt_lengths, no labels
            full = [p + r for p, r in zip(prompts, responses)]
            torch.testing.assert_close(whole[:, 0], torch.tensor(reward_fn([""] * 2, full), dtype=torch.float32))
            pos = torch.arange(width)[None]
            mask = (pos >= prompt_lengths[:, None]) & (pos < lengths[:, None])
            metrics = client.train_async(
                tokens, lengths, rewards.expand(-1, width) * mask, values, mask.float()
            ).result(60)
            assert metrics["tokens"] == mask.sum().item() and metrics["steps"] == 1
        procs = server.descendants()
        leftovers = triton_workspaces(procs) | stub_model_folders(procs)
        server.signal(signal.SIGINT)
        assert server.wait_exit(90) == 0, server.output[-3000:]
        assert "SIGINT received, stopping" in server.output
        assert wait_gone(procs) == []
        assert len(leftovers) == 5 and not any(os.path.exists(p) for p in leftovers)
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_reachable_address_without_a_secret_is_refused(tmp_path):
    port = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k != "ALIGNER_CRITIC_TOKEN"}
    proc = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--config-name",
            "ppo_critic_demo",
            "server.host=0.0.0.0",
            f"server.port={port}",
            f"exp_dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "ALIGNER_CRITIC_TOKEN" in proc.stderr and "Traceback" not in proc.stderr


def test_tritonserver_death_ends_the_job_with_the_reason(tmp_path):
    server = _demo_server(tmp_path)
    try:
        server.wait_ready()
        procs = server.descendants()
        (triton,) = [p for p in procs if p.name() == "tritonserver"]
        triton.kill()
        code = server.wait_exit(90)
        assert code == 1, server.output[-3000:]
        assert "tritonserver (or an endpoint's python stub) exited unexpectedly" in server.output
        assert str(tmp_path / "tritonserver.log") in server.output
        assert wait_gone(procs) == []
        assert not any(os.path.exists(p) for p in triton_workspaces(procs) | stub_model_folders(procs))
    finally:
        if server.proc.poll() is None:
            server.kill()


def _name(proc) -> str:
    """A process's name, "" once it has exited (start-up runs short-lived helpers)."""
    import psutil

    try:
        return proc.name()
    except psutil.Error:
        return ""


def test_tritonserver_exiting_before_it_is_ready_fails_the_start_at_once(tmp_path):
    """tritonserver exits before it is ready (as when another program takes one of its ports after the port check;
    here it is killed as soon as it appears). PyTriton alone keeps polling its HTTP port for 120 s; the critic notices
    the exit, names it, exits 1 and leaves nothing behind, well inside the 60 s this test waits."""
    server = ServerProcess(["--config-name", "ppo_critic_demo", f"server.port={free_ports(3)}", f"exp_dir={tmp_path}"])
    seen, folders, killed = {}, set(), False
    deadline = time.monotonic() + 120
    try:
        while server.proc.poll() is None and not killed and time.monotonic() < deadline:
            procs = server.descendants()
            seen.update((p.pid, p) for p in procs)
            folders |= triton_workspaces(procs)
            for p in procs:
                workspace = triton_workspaces([p]) if _name(p) == "tritonserver" else set()
                if workspace:  # killed once its workspace is known (not in the moment of its exec: next round)
                    folders |= workspace
                    p.kill()
                    killed = True
            time.sleep(0.05)
        assert killed, server.output[-3000:]
        code = server.wait_exit(60)
        assert code == 1, server.output[-3000:]
        assert "tritonserver (or an endpoint's python stub) exited unexpectedly" in server.output, server.output[-3000:]
        assert "not ready after timeout" not in server.output and "Traceback" not in server.output
        assert wait_gone(list(seen.values())) == []
        assert folders and not any(os.path.exists(f) for f in folders)
    finally:
        if server.proc.poll() is None:
            server.kill()


def test_sigterm_while_the_critic_starts_stops_it_cleanly(tmp_path):
    """SIGTERM as soon as tritonserver appears (the models are being built meanwhile, or Triton still loads its
    endpoints): exit 0, the signal named, no process, workspace or model folder left."""
    server = ServerProcess(["--config-name", "ppo_critic_demo", f"server.port={free_ports(3)}", f"exp_dir={tmp_path}"])
    seen, folders, signalled = {}, set(), False
    deadline = time.monotonic() + 120  # a job that does not stop fails here, not by hanging the suite
    try:
        while server.proc.poll() is None and time.monotonic() < deadline:
            procs = server.descendants()
            seen.update((p.pid, p) for p in procs)
            folders |= triton_workspaces(procs) | stub_model_folders(procs)
            if not signalled and any(_name(p) == "tritonserver" for p in procs):
                server.signal(signal.SIGTERM)
                signalled = True
            time.sleep(0.05)
        assert signalled, server.output[-3000:]
        assert server.wait_exit(5) == 0, server.output[-3000:]
        assert "SIGTERM received, stopping (before it was ready)" in server.output and "Traceback" not in server.output
        assert "critic server ready" not in server.output  # stopped before it was announced
        assert wait_gone(list(seen.values())) == []
        assert folders and not any(os.path.exists(f) for f in folders)
    finally:
        if server.proc.poll() is None:
            server.kill()


@pytest.mark.parametrize(
    "override, text",
    [("reward_fn=missing.py", "config error at 'reward_fn'"), ("server.port=70000", "outside 1..65535")],
)
def test_bad_config_exits_2_with_the_key(tmp_path, override, text):
    server = ServerProcess(["--config-name", "ppo_critic_demo", override, f"exp_dir={tmp_path}"])
    assert server.wait_exit(60) == 2 and text in server.output, server.output[-2000:]


def test_a_model_error_while_triton_starts_is_one_line_and_leaves_nothing(tmp_path):
    """Rank 0 builds the models while Triton starts (its endpoints load in the meantime): a build that fails on the
    user's input (here a model.checkpoint that is no checkpoint) still ends in one line and exit 2, after Triton
    and its python stubs are gone."""
    bad = tmp_path / "not_a_checkpoint"
    bad.mkdir()
    port = free_ports(3)
    server = ServerProcess(
        ["--config-name", "ppo_critic_demo", f"server.port={port}", f"exp_dir={tmp_path}", f"model.checkpoint={bad}"]
    )
    seen, folders = {}, set()
    while server.proc.poll() is None:
        procs = server.descendants()
        seen.update((p.pid, p) for p in procs)
        folders |= triton_workspaces(procs) | stub_model_folders(procs)
        time.sleep(0.1)
    code = server.wait_exit(60)
    assert code == 2, server.output[-3000:]
    assert f"{bad} is not a model checkpoint" in server.output and "Traceback" not in server.output
    assert folders, "Triton was not started while the models were built"
    assert wait_gone(list(seen.values())) == []
    assert not any(os.path.exists(f) for f in folders)


def test_a_frozen_python_stub_is_explained(tmp_path):
    """Triton's python backend declares an endpoint's stub unhealthy when it cannot run for ~1 s during a request
    (seen once in CI under load); reproduced here by freezing the stub. The client names the cause; the job ends
    without leaving processes behind once stopped."""
    import threading
    import time

    import psutil

    server = _demo_server(tmp_path)
    try:
        url = server.wait_ready()
        procs = server.descendants()
        (stub,) = [p for p in procs if "critic_resume_0_0" in " ".join(p.cmdline())]
        client = CriticClient(url, connect_timeout=30)
        client.wait_ready()
        stub.suspend()
        threading.Timer(2.5, stub.resume).start()
        with pytest.raises(CriticRequestError) as info:
            client.resume_async(None, "a1").result()
        assert "stopped responding" in str(info.value) and "is not healthy" in str(info.value), str(info.value)
        time.sleep(3)  # the stub is running again
        client.close()
        if server.proc.poll() is None:
            server.signal(signal.SIGTERM)
        code = server.wait_exit(90)
        assert code in (0, 1), server.output[-3000:]
        assert wait_gone(procs) == []
    finally:
        for p in server.descendants():
            try:
                p.resume()
            except psutil.NoSuchProcess:
                pass
        if server.proc.poll() is None:
            server.kill()
