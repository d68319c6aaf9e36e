"""A real `mpiexec -n 2` (the mpich wheel's): ranks discover themselves from PMI_* and join one gloo world."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from dist import free_port

PROGRAM = """
import json, os, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from aligner.parallel import discover, initialize, shutdown
info = discover()
initialize(tensor_parallel=2, seed=1)
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
row = {"rank": info.rank, "world": info.world_size, "source": info.source, "sum": t.item(),
       "tp_rank": ps.get_tensor_model_parallel_rank(), "backend": dist.get_backend()}
os.write(1, ("RESULT " + json.dumps(row) + "\\n").encode())  # one write: the two ranks share the pipe
shutdown()
"""


def _mpiexec():
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


@pytest.mark.skipif(_mpiexec() is None, reason="mpiexec not installed (pip install -e '.[mpi]')")
def test_mpiexec_two_ranks():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(
        [_mpiexec(), "-n", "2", sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = sorted(
        (json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert (r["world"], r["source"], r["sum"], r["backend"]) == (2, "mpich", 3.0, "gloo")
    assert [r["tp_rank"] for r in rows] == [0, 1]
