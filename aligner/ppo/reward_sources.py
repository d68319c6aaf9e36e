"""Reward sources: where the actor's per-sample scores (and, for GAE, the critic's values) come from.

Contract (every rank of the actor job builds the source after `aligner.parallel.initialize` and makes the same calls
in the same order; each call is collective over the job):
- `score(rollout) -> Pending[(values_BT | None, scores_B)]`: this rank's rows: the critic's values float32 [B, T]
  from a source with a value model (else None) and one float32 score per sample, on this rank's device. The work
  starts at once; `Pending.result()` (collective) waits, so the caller computes meanwhile.
- `close()`.
- Optional capability, its own Protocol: `TrainedCritic` (`train(rollout, returns_BS, values_BS) -> Pending[dict]`,
  `resume(step, run_id)`, `save(step, run_id) -> Pending[str | None]`): a value model that the loop trains and
  checkpoints with the policy (the run's checkpoint protocol, aligner.checkpoint.run). The other sources have no
  state: the actor sends them no critic_resume/critic_save, and its commit record covers the actor alone.
The sources (`build_reward_source` picks one from the config, once):
- `aligner.critic.remote.RemoteCritic`: the critic job with its value model (values, rewards; a TrainedCritic): gae.
- `CriticJobReward`: the critic job in reward-only mode (no value model): critic_infer's rewards alone.
- `LocalRewardFunction`: `reward.fn` run by the actor job itself (aligner.rewards.pool): on the first tensor- and
  pipeline-parallel rank of each data-parallel slice, for that slice's rows, on text decoded as the critic job's
  reward functions see it (prompt tokens and response tokens decoded apart, special tokens skipped). The scores
  reach the slice's other ranks by a sum over the model-parallel group; a failure on any rank stops every rank at
  the same call (the failing rank raises the error that names function and sample, the others point to it).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.critic.remote import Pending, RemoteCritic
from aligner.parallel.device import current_device
from aligner.rewards.function import RewardFunctionError
from aligner.rl._dist import all_reduce_


@runtime_checkable
class RewardSource(Protocol):
    def score(self, rollout) -> Pending: ...

    def close(self) -> None: ...


@runtime_checkable
class TrainedCritic(Protocol):
    def train(self, rollout, returns_BS: torch.Tensor, values_BS: torch.Tensor) -> Pending[dict]: ...

    def resume(self, step: int | None, run_id: str) -> str | None: ...

    def save(self, step: int, run_id: str) -> Pending: ...


class CriticJobReward:
    """The critic job in reward-only mode: scores from critic_infer, no values, nothing to train, save or resume."""

    def __init__(self, client_cfg, dp_group):
        self.remote = RemoteCritic(client_cfg, dp_group, reward_only=True)

    def score(self, rollout) -> Pending:
        return self.remote.infer(rollout, with_values=False)

    def close(self) -> None:
        self.remote.close()


def _failed_anywhere(failed: bool, device) -> bool:
    flag = torch.tensor([1.0 if failed else 0.0], device=device)
    all_reduce_(flag, dist.group.WORLD, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class LocalRewardFunction:
    def __init__(self, reward_cfg, tokenizer):
        from aligner.rewards.pool import RewardPool

        self.device = current_device()
        self.decode = tokenizer.decode
        self.mp_group = ps.get_model_parallel_group()
        self.computes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
        self.pool = self.thread = None
        error = None
        if self.computes:
            try:
                r = reward_cfg
                self.pool = RewardPool(r.fn, r.num_workers, r.timeout, r.samples_per_call)
            except RewardFunctionError as exc:
                error = exc
            self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        if _failed_anywhere(error is not None, self.device):  # no rank may go on into a collective alone
            self.close()
            raise error or RewardFunctionError(f"reward function {reward_cfg.fn} failed to load on another rank")

    def _texts_and_scores(self, tokens_BT, lengths_B, prompt_lengths_B, labels):
        prompts, responses = [], []
        for row, n, p in zip(tokens_BT.tolist(), lengths_B.tolist(), prompt_lengths_B.tolist()):
            prompts.append(self.decode(row[:p]))
            responses.append(self.decode(row[p:n]))
        return self.pool.score(prompts, responses, labels)

    def score(self, rollout) -> Pending:
        B = rollout.batch_size
        future = None
        if self.computes:  # decoded and scored in the background: the caller computes log-probs meanwhile
            args = (rollout.tokens_BT.cpu(), rollout.lengths_B.cpu(), rollout.prompt_lengths_B.cpu())
            future = self.thread.submit(self._texts_and_scores, *args, list(rollout.labels) or [None] * B)

        def finish():
            packet = torch.zeros(B + 1, dtype=torch.float64, device=self.device)  # [failed, scores...]
            error = None
            if future is not None:
                try:
                    packet[1:] = torch.from_numpy(future.result()).to(self.device)
                except RewardFunctionError as exc:
                    error, packet[0] = exc, 1.0
            all_reduce_(packet, self.mp_group)  # one contributor per slice: its rows reach the slice's ranks
            if _failed_anywhere(bool(packet[0].item()), self.device):
                raise error or RewardFunctionError(
                    "the reward function failed on another rank of the actor job: its error names the sample"
                )
            return None, packet[1:].to(torch.float32)

        return Pending(finish)

    def close(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=True)
            self.thread = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def build_reward_source(cfg, dp_group, tokenizer) -> RewardSource:
    """The source `reward.source` and `ppo.advantage_estimator` ask for (validated at config load)."""
    if cfg.reward.source == "function":
        return LocalRewardFunction(cfg.reward, tokenizer)
    if cfg.ppo.advantage_estimator == "gae":
        return RemoteCritic(cfg.critic, dp_group)
    return CriticJobReward(cfg.critic, dp_group)
