"""The run's commit record: which checkpoint steps the actor job and the critic job have *both* completed.

The two jobs checkpoint separately (each its own `step_*` directories, aligner.checkpoint.dist_ckpt). A step becomes
a resume point only once both have written it: the actor asks the critic to save step N (`critic_save`), writes its
own step N, and only then adds N to `<actor checkpoint dir>/committed.json`, atomically (temp file, then rename).
A crash at any moment therefore leaves either the old record (step N is ignored on both sides) or the new one.
A run without a trained critic (a critic-free estimator: its rewards from a reward-only critic job, which has no
state, or from the actor's own reward function) commits the same way with the actor's checkpoint alone.

Contract
- `new_run_id()`: a random id given to a run when it starts fresh; every checkpoint of the run carries it in its
  state.json (`run_id`), so a resume can tell that an actor checkpoint and a critic checkpoint belong together.
- `read(root) -> Commit | None`, `write(root, commit)` (one process), `commit(root, commit)` (collective: global rank
  0 writes, every rank waits), `Commit.add(step, keep)`, `agreed_run_id()` (collective: one new id for the job).
- `resume_points(root, commit)`: the committed steps, newest first, with the actor checkpoint of each and what is
  wrong with it (None when intact): the actor resumes from the newest intact step the critic can also load.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field

from aligner.checkpoint import dist_ckpt

RECORD = "committed.json"


@dataclass
class Commit:
    run_id: str
    steps: list[int] = field(default_factory=list)  # oldest first

    def add(self, step: int, keep: int | None) -> Commit:
        steps = sorted(set(self.steps) | {step})
        return Commit(self.run_id, steps[-keep:] if keep else steps)


def new_run_id() -> str:
    return secrets.token_hex(8)


def read(root: str) -> Commit | None:
    path = os.path.join(root, RECORD)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            data = json.load(f)
        return Commit(str(data["run_id"]), [int(s) for s in data["steps"]])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise dist_ckpt.CheckpointError(f"{path} is unreadable ({exc}): the run's commit record is damaged") from exc


def write(root: str, commit: Commit) -> None:
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f".{RECORD}.tmp")
    with open(tmp, "w") as f:
        json.dump({"run_id": commit.run_id, "steps": commit.steps}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, RECORD))


def commit(root: str, record: Commit) -> None:
    """Write the record on global rank 0; every rank of the job returns once it is on disk. Collective."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        write(root, record)
    if dist.is_initialized():
        from aligner.parallel import host_barrier

        host_barrier()


def agreed_run_id() -> str:
    """A new run id, the same on every rank (global rank 0's). Collective."""
    import torch.distributed as dist

    run_id = new_run_id()
    if dist.is_initialized():
        from aligner.parallel import host_broadcast

        run_id = host_broadcast(run_id)
    return run_id


def resume_points(root: str, commit: Commit) -> list[tuple[int, str, str | None]]:
    """(step, actor checkpoint path, problem or None) for each committed step, newest first."""
    out = []
    for step in reversed(commit.steps):
        path = os.path.join(root, dist_ckpt.step_dir_name(step))
        problem = dist_ckpt.verify(path)
        if problem is None and dist_ckpt.read_state(path).get("run_id") != commit.run_id:
            problem = f"{path} belongs to another run than {os.path.join(root, RECORD)}"
        out.append((step, path, problem))
    return out
