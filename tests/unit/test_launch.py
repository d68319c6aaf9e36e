"""Rank discovery from each launcher's environment, and backend choice."""

import pytest

from aligner.parallel.launch import discover, first_slurm_host, pick_backend


def test_slurm_environment():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu-[003-004]",
        "SLURM_JOB_ID": "1234",
        "SLURM_STEP_ID": "0",
    }
    info = discover(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (5, 8, 1, "gpu-003", "slurm")
    assert 20000 <= info.master_port < 40000
    assert discover(env).master_port == info.master_port  # every rank derives the same port
    assert discover(env, master_addr="head", master_port=7000)[3:5] == ("head", 7000)
    assert discover({**env, "MASTER_ADDR": "h", "MASTER_PORT": "1"})[3:5] == ("h", 1)


@pytest.mark.parametrize(
    "nodelist, first", [("n1", "n1"), ("node[7-9],x2", "node7"), ("a-[01,05]", "a-01"), ("c[100-101]", "c100")]
)
def test_first_slurm_host(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_torchrun_wins_over_slurm():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "6000",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
    }
    assert discover(env)[:6] == (1, 2, 1, "10.0.0.1", 6000, "torchrun")


def test_mpi_environments():
    ompi = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3"}
    assert discover(ompi)[:3] == (3, 4, 3) and discover(ompi).source == "openmpi"
    mpich = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}
    assert discover(mpich)[:3] == (1, 2, 1) and discover(mpich).source == "mpich"


def test_single_process_and_bad_rank():
    assert discover({})[:3] == (0, 1, 0)
    assert discover({}).master_port != 29500, "a world of one takes a free port: jobs on one machine must not collide"
    assert discover({"MASTER_PORT": "6001"}).master_port == 6001
    with pytest.raises(ValueError, match="outside a world of 2"):
        discover({"RANK": "2", "WORLD_SIZE": "2"})


def test_backend_choice_on_cpu():
    assert pick_backend("auto") == "gloo"
    assert pick_backend("gloo") == "gloo"
    with pytest.raises(ValueError, match="needs CUDA"):
        pick_backend("nccl")
    with pytest.raises(ValueError, match="auto, nccl or gloo"):
        pick_backend("mpi")


def test_a_failing_rank_names_its_exception_even_when_teardown_is_abandoned():
    """A rank that fails while its peers wait in a collective cannot finish destroy_process_group; shutdown then
    ends the process itself. The exception must still be named at once and its traceback printed (it used to be
    lost: only 'did not return' was logged). timeout_s=0 abandons the teardown at once."""
    import os
    import subprocess
    import sys

    from dist import free_port

    code = (
        "from aligner.parallel import initialize\n"
        "from aligner.parallel.launch import shutdown\n"
        f"initialize(1, 1, master_port={free_port()})\n"
        "try:\n"
        "    raise RuntimeError('boom in step 1')\n"
        "finally:\n"
        "    shutdown(exit_code_if_stuck=1, timeout_s=0)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "rank 0 failed (RuntimeError: boom in step 1); tearing down" in out.stderr
    assert "Traceback (most recent call last)" in out.stderr and "RuntimeError: boom in step 1" in out.stderr
