"""dist_ckpt.start_writer: megatron's checkpoint writer helper (a 'spawn' Manager process) is started in the background
at job start (start_writer does not wait for it) and made ready (torch imported there) before the first save, not
inside it; its queue is left empty; a SIGTERM sent to the whole
job (as scancel does before the job's last checkpoint) leaves it serving; and it ends when the job is killed with
SIGKILL. megatron's own helper would die of the SIGTERM (the last save fails) and outlive the SIGKILL.

Run in a fresh interpreter whose main script does not import torch, as a job's Manager would start from one: the
helper is only created once per process, so the pytest process (where other tests saved already) cannot show it.
"""

import os
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BODY = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})

    def torch_mapped(pid):
        with open(f"/proc/{{pid}}/maps") as f:
            return "libtorch" in f.read()

    def main():
        import psutil
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from aligner.checkpoint import dist_ckpt
        from aligner.models.gpt import build_gpt
        from aligner.config import ModelConfig
        from aligner.parallel import initialize
        from aligner.utils.net import free_port_range

        initialize(1, 1, master_port=free_port_range(1))
        assert filesystem_async._results_queue is None, "the helper exists before start_writer"
        dist_ckpt.start_writer()
        print("start_writer returned before the helper was ready", not dist_ckpt._writer_ready.is_set())
        dist_ckpt.wait_writer()
        queue = filesystem_async._results_queue
        assert queue is not None and queue.qsize() == 0, "start_writer left something in megatron's queue"
        helpers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(helpers) == 1, helpers
        print("helper_has_torch", torch_mapped(helpers[0].pid))
        print("helper_pid", helpers[0].pid)
        model = build_gpt(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64))
        # What scancel and our launchers do: SIGTERM to every process of the job, which then saves a last time.
        signal.signal(signal.SIGTERM, lambda *_: print("job got SIGTERM", flush=True))
        os.killpg(0, signal.SIGTERM)
        time.sleep(1)
        path = dist_ckpt.save(sys.argv[1], 1, [model])
        print("saved", os.path.isfile(os.path.join(path, "state.json")), "queue", queue.qsize(), flush=True)
        os.kill(os.getpid(), 9)  # a job killed outright: no atexit, no finalizers

    if __name__ == "__main__":
        main()
""")


def test_start_writer_readies_megatron_helper_before_the_first_save(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(BODY.format(repo=REPO))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    # Output to files, not pipes: a helper left behind would hold a pipe open and stall the call instead of failing.
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        code = subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ckpt")],
            stdout=fo,
            stderr=fe,
            env=env,
            timeout=240,
            start_new_session=True,
        ).returncode
    stdout = out.read_text()
    assert code == -9, err.read_text()[-3000:]
    assert "start_writer returned before the helper was ready True" in stdout, stdout
    assert "helper_has_torch True" in stdout, stdout
    assert "job got SIGTERM" in stdout and "saved True queue 0" in stdout, stdout
    pid = int(stdout.split("helper_pid ")[1].split()[0])
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), f"the writer helper (pid {pid}) outlived its killed job"


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _return_while_the_helper_starts(report):
    """A multiprocessing child (as a test's rank is) that ends while its writer helper is still starting."""
    import psutil

    from aligner.checkpoint import dist_ckpt

    dist_ckpt.start_writer()
    deadline = time.monotonic() + 60
    helpers = []
    while not helpers and time.monotonic() < deadline:
        helpers = [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())]
        time.sleep(0.02)
    report.put((helpers[0].pid if helpers else None, dist_ckpt._writer_ready.is_set()))


def test_a_process_that_ends_while_its_helper_starts_exits_and_ends_it():
    """multiprocessing ends a child by running its finalizers and then joining the child's own children: the helper
    was joined before it had a finalizer that stops it (it ignores SIGTERM), and such a rank never exited (CI: the
    test ranks that trained a few steps without saving)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    report = ctx.Queue()
    child = ctx.Process(target=_return_while_the_helper_starts, args=(report,))
    child.start()
    pid, ready = report.get(timeout=120)
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert pid is not None and not ready, "the helper was not caught starting"
    assert not alive, "the process waited for its checkpoint writer helper forever"
    deadline = time.monotonic() + 20
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid), f"the writer helper (pid {pid}) outlived its process"
