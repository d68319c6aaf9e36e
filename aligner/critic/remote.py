"""The critic job as every rank of the actor job sees it: requests that return pending results.

Contract
- Every rank of the actor job constructs `RemoteCritic(client_cfg, dp_group)` after `aligner.parallel.initialize`
  and makes the same calls in the same order; each call is collective over the actor job.
- Who sends: global rank 0 alone talks to the critic job, one HTTP request per call for the whole job's batch. The
  rows of the other data-parallel slices reach it first (a gather over rank 0's data-parallel group: token ids, a
  few KB), in global-position order, so the critic sees the same batch for any DP size. The answer is broadcast
  from rank 0 to every rank, and each rank keeps its own rows. Requests are futures on rank 0: the critic computes
  while the actor computes; `Pending.result()` (collective) waits.
- `infer(rollout, with_values=True) -> Pending[(values_BT, scores_B)]`: this rank's rows of the critic's values on
  the [B, T] grid and the reward score per sample (float32, on this rank's device); values_BT is None with
  `with_values=False` (nothing but the scores is broadcast). `score(rollout)` is `infer(rollout)`: the reward-source
  interface of aligner.rewards, of which RemoteCritic is the critic-with-values member.
- `RemoteCritic(..., reward_only=True)` talks to a critic job in reward-only mode: it waits for critic_infer alone
  (the job binds no critic_train, critic_save or critic_resume: it has no state to train, save or resume, and its
  caller, aligner.ppo.reward_sources.CriticJobReward, sends only critic_infer).
- `train(rollout, returns_BS, values_BS) -> Pending[dict]`: `critic_train` on the rollout's returns and old values
  (shifted grid [B, T-1] here; the critic's [B, T] grid gets an empty last position); metrics
  `critic/value_loss`, `critic/explained_var`, `critic/value_clipfrac`, `critic/grad_norm`,
  `critic/skipped_steps` on every rank.
- `resume(step, run_id) -> str | None` (blocking, collective): `critic_resume`, once, before the run's first
  request: the critic loads its checkpoint of committed step `step` of run `run_id` (None: a fresh run). Raises
  `CriticCheckpointError` on every rank when the critic cannot (missing, damaged, another run).
- `save(step, run_id) -> Pending[str | None]`: `critic_save`; the critic's checkpoint path on rank 0, None
  elsewhere; `result()` raises on every rank when the save failed.
- `close()` ends rank 0's client.
Rollouts are `aligner.ppo.rollout.Rollout`-like: `tokens_BT`, `lengths_B`, `prompt_lengths_B`, `labels`, and
`positions` (each row's position in the step's global batch).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Generic, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.critic.protocol import CriticCheckpointError
from aligner.parallel import host_broadcast
from aligner.parallel.device import current_device

T = TypeVar("T")


class CriticCallError(RuntimeError):
    """A critic request of global rank 0 failed (raised on the other ranks; rank 0 raises the original error)."""


TRAIN_METRICS = {
    "critic/value_loss": "loss",
    "critic/explained_var": "explained_variance",
    "critic/value_clipfrac": "value_clipfrac",
    "critic/grad_norm": "grad_norm",
    "critic/skipped_steps": "skipped_steps",
}


class Pending(Generic[T]):
    """A request in flight; `result()` is collective over the actor job (every rank calls it, in call order)."""

    def __init__(self, finish: Callable[[], T]):
        self._finish = finish

    def result(self) -> T:
        return self._finish()


class RemoteCritic:
    def __init__(self, client_cfg, dp_group, reward_only: bool = False):
        self.rank = dist.get_rank()
        self.dp_group = dp_group
        self.dp = dist.get_world_size(dp_group)
        self.device = current_device()
        # Rank 0's data-parallel group: the ranks whose rows go into the request (one per slice).
        self.gathers = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
        self.client = None
        if self.rank == 0:
            from aligner.critic import protocol
            from aligner.critic.client import CriticClient

            endpoints = (protocol.INFER,) if reward_only else protocol.ENDPOINTS
            self.client = CriticClient.from_config(client_cfg, endpoints)
            start = client_cfg.start_timeout
            self.client.wait_ready(client_cfg.connect_timeout if start is None else start)

    # -- requests ------------------------------------------------------------------------------------------
    def score(self, rollout) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        return self.infer(rollout)

    def infer(self, rollout, with_values: bool = True) -> Pending[tuple[torch.Tensor | None, torch.Tensor]]:
        tokens, lengths, prompt_lengths, labels = self._gather(
            rollout,
            rollout.tokens_BT.cpu().numpy(),
            rollout.lengths_B.cpu().numpy(),
            rollout.prompt_lengths_B.cpu().numpy(),
            list(rollout.labels),
        )
        future = None
        if self.rank == 0:
            has_labels = any(x is not None for x in labels)
            future = self.client.infer_async(tokens, lengths, prompt_lengths, labels=labels if has_labels else None)
        B, T = rollout.tokens_BT.shape
        mine = torch.tensor(rollout.positions, device=self.device)

        def finish():
            values = torch.zeros(B * self.dp, T if with_values else 0, dtype=torch.float32)
            scores = torch.zeros(B * self.dp, dtype=torch.float32)
            answer = self._settle(future)
            if answer is not None:
                v, r = answer
                if with_values:
                    values.copy_(torch.as_tensor(np.asarray(v, dtype=np.float32)))
                scores.copy_(torch.as_tensor(np.asarray(r, dtype=np.float32)).reshape(-1))
            values, scores = values.to(self.device), scores.to(self.device)
            if with_values:
                dist.broadcast(values, src=0)
            dist.broadcast(scores, src=0)
            return (values[mine] if with_values else None), scores[mine]

        return Pending(finish)

    def train(self, rollout, returns_BS: torch.Tensor, values_BS: torch.Tensor) -> Pending[dict]:
        def full_grid(x_BS):  # the critic's [B, T] grid: the shifted grid plus an empty last position
            return torch.nn.functional.pad(x_BS.float(), (0, 1)).cpu().numpy()

        gathered = self._gather(
            rollout,
            rollout.tokens_BT.cpu().numpy(),
            rollout.lengths_B.cpu().numpy(),
            full_grid(returns_BS),
            full_grid(values_BS),
            full_grid(rollout.mask_BS),
        )
        future = self.client.train_async(*gathered) if self.rank == 0 else None

        def finish():
            out = torch.zeros(len(TRAIN_METRICS), dtype=torch.float64)
            result = self._settle(future)
            if result is not None:
                out = torch.tensor([float(result[k]) for k in TRAIN_METRICS.values()], dtype=torch.float64)
            out = out.to(self.device)
            dist.broadcast(out, src=0)
            return dict(zip(TRAIN_METRICS, out.tolist(), strict=True))

        return Pending(finish)

    def resume(self, step: int | None, run_id: str) -> str | None:
        future = self.client.resume_async(step, run_id) if self.rank == 0 else None
        return self._settle(future)

    def save(self, step: int, run_id: str) -> Pending[str | None]:
        future: Future | None = self.client.save_async(step, run_id) if self.rank == 0 else None
        return Pending(lambda: self._settle(future))

    def _settle(self, future: Future | None):
        """Rank 0 waits for its request; a failure is raised on every rank (rank 0: the original exception; the
        others: the same kind for a checkpoint refusal, else CriticCallError), so no rank is left waiting in a
        collective for an answer that never comes."""
        result, failure, original = None, None, None
        if future is not None:
            try:
                result = future.result()
            except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
                failure = (isinstance(exc, CriticCheckpointError), f"{type(exc).__name__}: {exc}")
                original = exc
        failure = host_broadcast(failure)  # the other ranks wait for rank 0's HTTP answer on the CPU
        if failure is None:
            return result
        if original is not None:
            raise original
        is_checkpoint, message = failure
        raise (CriticCheckpointError if is_checkpoint else CriticCallError)(f"on global rank 0: {message}")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- transport -----------------------------------------------------------------------------------------
    def _gather(self, rollout, *arrays) -> list:
        """The whole global batch on global rank 0, rows in global-position order; a list of None elsewhere."""
        if not self.gathers:
            return [None] * len(arrays)
        parts = [None] * self.dp if self.rank == 0 else None
        dist.gather_object(
            (rollout.positions, arrays), parts, dst=dist.get_global_rank(self.dp_group, 0), group=self.dp_group
        )
        if self.rank != 0:
            return [None] * len(arrays)
        order = np.argsort(np.concatenate([np.asarray(pos) for pos, _ in parts]), kind="stable")
        out = []
        for i, a in enumerate(arrays):
            if isinstance(a, list):
                flat = [x for _, arrs in parts for x in arrs[i]]
                out.append([flat[j] for j in order])
            else:
                out.append(np.concatenate([arrs[i] for _, arrs in parts])[order])
        return out
