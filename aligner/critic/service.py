"""The critic job's logic as a plain SPMD class: value model (trained) + reward (model or function).

Contract
- Every rank of the critic job constructs `CriticService(cfg)` after `aligner.parallel.initialize` and then makes the
  same calls, with the same full-batch arguments, in the same order (the server broadcasts each request first).
  `infer`, `train` and `save` are collective over the whole world; their results are identical on every rank.
- Layout: each data-parallel rank processes a contiguous slice of the batch rows (tensor-parallel ranks of one
  slice process the same rows, pipeline stages pass activations); results are assembled on every rank with one
  all-reduce over the default group, where only one rank per slice (TP rank 0 of the last PP stage) contributes.
- `infer(tokens_BT, lengths_B, prompt_lengths_B=None, labels=None) -> (values_BT, rewards_B1)`: values[b, t] is the
  critic's output at position t (the actor decides which positions it uses), 0 at t >= lengths[b]; zeros [B, 1] in
  reward-only mode (`model: null`: no value model, no state; `train`, `resume` and `save` then raise
  CriticRequestError, and the server binds none of them). Rewards: the reward model's scalar at position
  lengths[b] - 1, standardised by `cfg.reward_scaling()` (the config's reward_mean/std, else the reward model
  checkpoint's reward_stats.json); or `reward_fn` on decoded text, computed on global rank 0 only and broadcast (see
  aligner.critic.reward_fn).
- `train(tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> metrics`: `train.epochs` passes over the rows
  in order, one optimizer step per `train.global_batch_size` rows; clipped value loss (aligner.rl.value_loss)
  normalised by the global number of masked tokens of each global batch. `explained_variance` is that of the
  rollout values (`prev_values`) against the returns, i.e. how well the critic predicted before this update.
- `resume(step, run_id) -> path | None` (once, before anything else of a run): the actor says which run this is and
  which committed step it resumes (step < 0: a fresh run). The critic loads its own `step_<step>` (weights,
  optimizer, RNG), checks that it belongs to `run_id`, and removes its checkpoints of that run past `step` (saved
  by a `critic_save` whose actor checkpoint was never committed). `CriticCheckpointError` when it cannot: the step
  is missing or damaged (the actor may try an older committed step), or belongs to another run.
- `save(step, run_id) -> path`: a dist checkpoint of the critic and its optimizer under `checkpoint.dir`. Only the
  actor's next step is accepted (the resumed step plus the `train` calls since, one per PPO step), only for the
  run of `resume`, and a complete checkpoint is never overwritten.
- Bad inputs raise `CriticRequestError` (from aligner.critic.protocol) before any collective, identically on every
  rank, so a rejected request leaves the ranks in step.
"""

from __future__ import annotations

import logging
import os
import shutil
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.checkpoint import dist_ckpt
from aligner.config.critic import CriticJobConfig
from aligner.critic.protocol import (
    CriticCheckpointError,
    CriticRequestError,
    Limits,
    check_infer,
    check_run_id,
    check_step,
    check_train,
)
from aligner.critic.reward_fn import RewardFunction, RewardFunctionError
from aligner.data.packing import trimmed_groups
from aligner.parallel import host_barrier, host_group
from aligner.parallel.device import current_device
from aligner.rl import explained_variance, global_token_count, reduce_stats, value_loss
from aligner.rl._dist import all_reduce_

LOG = logging.getLogger(__name__)


def dp_rows(batch: int, dp_size: int, dp_rank: int) -> tuple[int, int]:
    """[start, stop) of the rows data-parallel rank `dp_rank` owns: contiguous, sizes differing by at most one."""
    base, extra = divmod(batch, dp_size)
    start = dp_rank * base + min(dp_rank, extra)
    return start, start + base + (1 if dp_rank < extra else 0)


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CriticService:
    def __init__(self, cfg: CriticJobConfig):
        from aligner.models.training import TrainableModel

        self.cfg = cfg
        self.device = current_device()
        self.dp_group = ps.get_data_parallel_group()
        vocab = cfg.vocab_size if cfg.vocab_size is not None else 2**62
        self.limits = Limits(cfg.server.max_batch_size, cfg.max_seq_len, vocab, cfg.server.max_train_batch_size)
        self.critic = None  # reward-only mode (model: null): no value model, values are zeros [B, 1]
        if cfg.model is not None:
            self.critic = TrainableModel(cfg.model, cfg.optim, head="scalar")
            if cfg.model.checkpoint:
                backbone_only = _is_lm_checkpoint(cfg.model.checkpoint)
                load = dist_ckpt.load_backbone_weights if backbone_only else dist_ckpt.load_model_weights
                load(cfg.model.checkpoint, [self.critic.module])
                self.critic.weights_loaded()
        self.reward_model = None
        if cfg.reward_model is not None:
            self.reward_model = TrainableModel(cfg.reward_model, cfg.optim, head="scalar", trainable=False)
            if cfg.reward_model.checkpoint:
                dist_ckpt.load_model_weights(cfg.reward_model.checkpoint, [self.reward_model.module])
            else:
                LOG.warning("reward_model.checkpoint is not set: the reward model has random weights")
            self.reward_mean, self.reward_std, source = cfg.reward_scaling()
            mean, std = self.reward_mean, self.reward_std
            LOG.warning("reward model scores standardised with mean %g, std %g, from %s", mean, std, source)
        # Loaded on every rank (a broken file fails everywhere at start-up), called on global rank 0 only.
        self.reward_function = None
        if cfg.reward_fn:  # the workers on rank 0, the one rank that calls the function (_rewards_from_fn)
            workers = cfg.reward_fn_workers if _global_rank() == 0 else 0
            self.reward_function = RewardFunction(
                cfg.reward_fn, cfg.tokenizer_path, workers, cfg.reward_fn_timeout, cfg.reward_fn_samples_per_call
            )
        # Micro-batches cut to their longest row (sorted by length); under PP every micro-batch keeps one shape.
        self.trim = cfg.trim_padding if ps.get_pipeline_model_parallel_world_size() == 1 else 0
        self.run_id: str | None = None  # set by resume(): the actor's run
        self.base_step = 0  # the step the critic's state corresponds to (resumed or last saved)
        self.trains_since_base = 0
        self.resumed_from: str | None = None

    # -- layout helpers ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the reward function's worker processes (idempotent; they also exit when this process does)."""
        if self.reward_function is not None:
            self.reward_function.close()

    def _my_rows(self, batch: int) -> tuple[int, int]:
        return dp_rows(batch, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())

    def _sum_over_dp(self, t: torch.Tensor) -> torch.Tensor:
        """Every data-parallel rank wrote its own rows (zeros elsewhere): the sum is the whole batch, on every rank
        (TP ranks and pipeline stages of a slice hold the same rows already: TrainableModel hands every rank its
        outputs)."""
        return all_reduce_(t, self.dp_group)

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device)

    @staticmethod
    def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
        pad = (-t.shape[0]) % multiple
        return torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t

    # -- infer -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def infer(self, tokens_BT, lengths_B, prompt_lengths_B=None, labels=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Values float32 [B, T] and rewards float32 [B, 1] (CPU tensors, identical on every rank)."""
        tokens, lengths, prompt_lengths, labels = check_infer(
            tokens_BT, lengths_B, prompt_lengths_B, labels, self.limits
        )
        batch, seq = tokens.shape
        width = int(lengths.max())  # positions past every length cannot influence earlier ones (causal)
        valid_BT = np.arange(width)[None, :] < lengths[:, None]
        tokens_dev = self._to_device(np.where(valid_BT, tokens[:, :width], 0))
        lengths_dev = self._to_device(lengths)

        # One flat buffer: [values B*width | rewards B], summed over data-parallel ranks in one collective.
        vwidth = width if self.critic is not None else 0
        out = torch.zeros(batch * vwidth + batch, dtype=torch.float32, device=self.device)
        values_BT, rewards_B = out[: batch * vwidth].view(batch, vwidth), out[batch * vwidth :]
        start, stop = self._my_rows(batch)
        if stop > start:  # a DP slice with no rows skips the forward (no collective spans DP in a forward pass)
            if self.critic is not None:
                values_BT[start:stop] = self._forward_values(self.critic, tokens_dev[start:stop], lengths[start:stop])
            if self.reward_model is not None:
                scores = self._forward_values(self.reward_model, tokens_dev[start:stop], lengths[start:stop])
                last = (lengths_dev[start:stop] - 1).unsqueeze(1)
                rm_B = scores.gather(1, last).squeeze(1)
                rewards_B[start:stop] = (rm_B - self.reward_mean) / self.reward_std
        self._sum_over_dp(out)
        # Reward-only mode: zeros [B, 1] (PyTriton cannot carry a tensor with a zero dimension).
        values = torch.zeros(batch, seq if self.critic is not None else 1, dtype=torch.float32)
        values[:, :vwidth] = values_BT.cpu() * torch.from_numpy(valid_BT[:, :vwidth])
        if self.reward_function is not None:
            rewards = self._rewards_from_fn(tokens, lengths, prompt_lengths, labels)
        else:
            rewards = rewards_B.cpu()
        return values, rewards.reshape(batch, 1)

    def _forward_values(self, model, tokens_bT: torch.Tensor, lengths_b: np.ndarray) -> torch.Tensor:
        """Scalar-head outputs [b, T] float32 for `tokens_bT` (zeros past a micro-batch's width when cut)."""
        rows = tokens_bT.shape[0]
        infer = self.cfg.infer
        micro = self._micro_batches(infer.micro_batch_size, infer.micro_batch_tokens, lengths_b, tokens=tokens_bT)
        outs = model.forward(micro, lambda batch, output: output.squeeze(-1).float())
        padded = sum(len(mb["rows"]) for mb in micro)  # the micro-batches' rows: a permutation of range(padded)
        values = torch.zeros(padded, tokens_bT.shape[1], dtype=torch.float32, device=tokens_bT.device)
        for mb, part in zip(micro, outs, strict=True):
            values[mb["rows"], : part.shape[1]] = part
        return values[:rows]

    def _micro_batches(self, size: int, max_tokens: int | None, lengths_b: np.ndarray, **tensors) -> list[dict]:
        """Micro-batches of `size` rows (or as many as fit in `max_tokens` tokens) of each [b, T] tensor, with `rows`
        (a tensor: which rows each holds). Cut to their longest row (`self.trim`, rows sorted by length), else in
        order at the whole width with the last filled by zero rows (equal shapes, as the pipeline schedule
        requires)."""
        first = next(iter(tensors.values()))
        rows, width = first.shape
        lengths = lengths_b.tolist()
        if not self.trim and max_tokens is None:
            tensors = {name: self._pad_rows(x, size) for name, x in tensors.items()}
            lengths += [0] * ((-rows) % size)
        micro = []
        for group, w in trimmed_groups(lengths, size, self.trim, width, max_tokens):
            idx = torch.tensor(group, device=first.device)
            micro.append({"rows": idx, **{name: x[idx, :w] for name, x in tensors.items()}})
        return micro

    def _rewards_from_fn(self, tokens, lengths, prompt_lengths, labels) -> torch.Tensor:
        """Rank 0 runs the reward function; [ok, rewards...] is broadcast so every rank returns (or raises) alike.
        Over the host group: the other ranks wait on the CPU while rank 0 computes."""
        batch = tokens.shape[0]
        packet = torch.zeros(batch + 1, dtype=torch.float64)
        error = None
        if _global_rank() == 0:
            try:
                packet[1:] = torch.from_numpy(self.reward_function(tokens, lengths, prompt_lengths, labels))
                packet[0] = 1.0
            except RewardFunctionError as exc:
                error = exc
        if _world() > 1:
            dist.broadcast(packet, src=0, group=host_group())
        if packet[0].item() != 1.0:
            raise error or RewardFunctionError("the reward function failed on rank 0 (see rank 0's error)")
        return packet[1:].to(torch.float32)

    # -- train -------------------------------------------------------------------------------------------
    def train(self, tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> dict[str, float]:
        """Train the critic on one batch of rollouts; returns metrics (see protocol.TRAIN_METRICS)."""
        self._require_value_model("train")
        tokens, lengths, returns, prev_values, mask = check_train(
            tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT, self.limits
        )
        self.trains_since_base += 1  # one critic_train per PPO step: critic_save checks the step against it
        batch = tokens.shape[0]
        width = int(lengths.max())
        valid_BT = np.arange(width)[None, :] < lengths[:, None]
        mask = mask[:, :width]
        # Zero (not just mask out) unused positions: a NaN there would reach the gradient through 0 * NaN.
        tokens_dev = self._to_device(np.where(valid_BT, tokens[:, :width], 0))
        mask_dev = self._to_device(mask)
        returns_dev = self._to_device(np.where(mask != 0, returns[:, :width], 0.0).astype(np.float32))
        prev_dev = self._to_device(np.where(mask != 0, prev_values[:, :width], 0.0).astype(np.float32))
        ev = float(explained_variance(prev_dev, returns_dev, mask_dev))

        cfg = self.cfg.train
        stats, grad_norms, skipped, lr = [], [], 0, 0.0
        for _ in range(cfg.epochs):
            for gb_start in range(0, batch, cfg.global_batch_size):
                gb_size = min(cfg.global_batch_size, batch - gb_start)
                lo, hi = (gb_start + r for r in self._my_rows(gb_size))
                micro = self._train_micro_batches(
                    tokens_dev[lo:hi], returns_dev[lo:hi], prev_dev[lo:hi], mask_dev[lo:hi], width, lengths[lo:hi]
                )
                num_tokens = global_token_count([m["mask"] for m in micro], group=self.dp_group)
                result = self.critic.step(micro, partial(self._loss, num_tokens=num_tokens))
                stats += result["stats"]
                grad_norms.append(result["grad_norm"])
                skipped += result["skipped"]
                lr = result["lr"]
        total = reduce_stats(stats, group=self.dp_group)
        return {
            "loss": total["vf_loss"],
            "value_clipfrac": total["vf_clipfrac"],
            "grad_norm": float(np.nanmean(grad_norms)) if skipped < len(grad_norms) else float("nan"),
            "explained_variance": ev,
            "value_mean": total["value"],
            "tokens": total["tokens"] / cfg.epochs,
            "steps": float(len(grad_norms)),
            "skipped_steps": float(skipped),
            "lr": lr,
        }

    def _train_micro_batches(self, tokens, returns, prev_values, mask, width, lengths) -> list[dict]:
        if tokens.shape[0] == 0:
            # This DP rank got no rows of a small global batch, but must still join the gradient all-reduce:
            # one all-padding micro-batch (mask 0) contributes exactly zero gradient.
            tokens, returns, prev_values, mask = (x.new_zeros((1, width)) for x in (tokens, returns, prev_values, mask))
            lengths = np.full(1, width)
        train = self.cfg.train
        tensors = {"tokens": tokens, "returns": returns, "prev_values": prev_values, "mask": mask}
        return self._micro_batches(train.micro_batch_size, train.micro_batch_tokens, lengths, **tensors)

    def _loss(self, batch: dict, output: torch.Tensor, num_tokens: int):
        values_BT = output.squeeze(-1).float()
        loss, stats = value_loss(
            values_BT,
            batch["prev_values"],
            batch["returns"],
            batch["mask"],
            num_tokens,
            clip_eps=self.cfg.train.value_clip_eps,
        )
        return loss, stats

    def _require_value_model(self, what: str) -> None:
        if self.critic is None:  # the server binds none of these endpoints in this mode: a direct call is a bug
            raise CriticRequestError(f"critic_{what}: this critic job is in reward-only mode (model: null)")

    # -- checkpoints -------------------------------------------------------------------------------------
    def resume(self, step: int, run_id: str) -> str | None:
        """Start run `run_id` at its committed `step` (< 0: fresh); see the module docstring. Collective."""
        self._require_value_model("resume")
        step, run_id = check_step(step, allow_fresh=True), check_run_id(run_id)
        root = self.cfg.checkpoint_dir
        if step < 0:
            if self.trains_since_base or self.run_id not in (None, run_id) or self.resumed_from:
                raise CriticCheckpointError(
                    "the critic has already trained for another run since it started: restart the critic job to "
                    "start a fresh run"
                )
            others = [p for _, p in dist_ckpt.complete_checkpoints(root) if _run_of(p) != run_id]
            if others:
                raise CriticCheckpointError(
                    f"checkpoint.dir {root} holds checkpoints of another run ({os.path.basename(others[-1])}, ...): "
                    "a fresh run would overwrite them; give the critic another exp_dir (or remove them)"
                )
            LOG.warning("run %s: starting fresh (no committed checkpoint)", run_id)
            self.run_id, self.base_step, self.trains_since_base = run_id, 0, 0
            return None
        if not self.cfg.checkpoint.resume:
            raise CriticCheckpointError(
                f"the actor resumes run {run_id} at step {step}, but the critic's checkpoint.resume=false: "
                "set it to true (or start the actor fresh)"
            )
        path = os.path.join(root, dist_ckpt.step_dir_name(step))
        problem = dist_ckpt.verify(path)
        if problem is None and _run_of(path) != run_id:
            problem = f"{path} belongs to run {_run_of(path)}, not to the actor's run {run_id}"
        if problem:
            raise CriticCheckpointError(problem)
        state = dist_ckpt.load(path, [self.critic.module], self.critic.optimizer)
        self.critic.steps_taken = int(state.get("optimizer_steps", 0))
        for later, stale in dist_ckpt.complete_checkpoints(root):
            if later > step and _run_of(stale) == run_id and _global_rank() == 0:
                LOG.warning("removing %s: saved, but the actor never committed that step", stale)
                shutil.rmtree(stale, ignore_errors=True)
        if dist.is_initialized():
            host_barrier()  # rank 0 removed the stale checkpoints
        self.run_id, self.base_step, self.trains_since_base, self.resumed_from = run_id, step, 0, path
        LOG.warning("run %s: resumed from %s at step %d", run_id, path, step)
        return path

    def save(self, step, run_id) -> str:
        """Write `<checkpoint.dir>/step_<step>` (critic weights, optimizer, RNG); returns its path. Collective."""
        self._require_value_model("save")
        step, run_id = check_step(step), check_run_id(run_id)
        if self.run_id is None or run_id != self.run_id:
            raise CriticCheckpointError(
                f"critic_save for run {run_id}, but the critic serves run {self.run_id}: the actor sends "
                "critic_resume first"
            )
        expected = self.base_step + self.trains_since_base
        if step != expected:
            raise CriticCheckpointError(
                f"critic_save step {step}: the critic has trained to step {expected} of run {run_id} "
                f"(resumed or saved at {self.base_step}, {self.trains_since_base} critic_train since)"
            )
        try:
            path = dist_ckpt.save(
                self.cfg.checkpoint_dir,
                step,
                [self.critic.module],
                self.critic.optimizer,
                state={"optimizer_steps": self.critic.steps_taken, "job": "critic", "run_id": run_id},
                keep=self.cfg.checkpoint.keep,
                model_cfg=self.cfg.model,
                replace=False,
            )
        except (FileExistsError, dist_ckpt.CheckpointWriteError) as exc:  # raised on every rank alike
            raise CriticCheckpointError(str(exc)) from exc
        self.base_step, self.trains_since_base = step, 0
        return path


def _run_of(path: str) -> str | None:
    try:
        return dist_ckpt.read_state(path).get("run_id")
    except (OSError, ValueError):
        return None


def _is_lm_checkpoint(path: str) -> bool:
    """A policy (LM-head) checkpoint: the critic takes its backbone and keeps a fresh value head, as NeMo-Aligner's
    critic does when it starts from the SFT policy."""
    if dist_ckpt.head_kind(path) != "lm":
        return False
    LOG.warning("model.checkpoint %s holds an LM head: loading its backbone, the value head starts fresh", path)
    return True
