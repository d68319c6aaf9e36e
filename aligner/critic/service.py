"""The critic job's logic as a plain SPMD class: value model (trained) + reward (model or function).

Contract
- Every rank of the critic job constructs `CriticService(cfg)` after `aligner.parallel.initialize` and then makes the
  same calls, with the same full-batch arguments, in the same order (the server broadcasts each request first).
  `infer`, `train` and `save` are collective over the whole world; their results are identical on every rank.
- Layout: each data-parallel rank processes a contiguous slice of the batch rows (tensor-parallel ranks of one
  slice process the same rows, pipeline stages pass activations); results are assembled on every rank with one
  all-reduce over the default group, where only one rank per slice (TP rank 0 of the last PP stage) contributes.
- `infer(tokens_BT, lengths_B, prompt_lengths_B=None, labels=None) -> (values_BT, rewards_B1)`: values[b, t] is the
  critic's output at position t (the actor decides which positions it uses), 0 at t >= lengths[b]. Rewards: the
  reward model's scalar at position lengths[b] - 1, standardised by reward_mean/std; or `reward_fn` on decoded
  text, computed on global rank 0 only and broadcast (see aligner.critic.reward_fn).
- `train(tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> metrics`: `train.epochs` passes over the rows
  in order, one optimizer step per `train.global_batch_size` rows; clipped value loss (aligner.rl.value_loss)
  normalised by the global number of masked tokens of each global batch. `explained_variance` is that of the
  rollout values (`prev_values`) against the returns, i.e. how well the critic predicted before this update.
- `save(step) -> path`: a dist checkpoint of the critic and its optimizer under `checkpoint.dir`.
- Bad inputs raise `CriticRequestError` (from aligner.critic.protocol) before any collective, identically on every
  rank, so a rejected request leaves the ranks in step.
"""

from __future__ import annotations

import logging
import os
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.checkpoint import dist_ckpt
from aligner.config.critic import CriticJobConfig
from aligner.critic.protocol import Limits, check_infer, check_step, check_train
from aligner.critic.reward_fn import RewardFunction, RewardFunctionError
from aligner.rl import explained_variance, global_token_count, value_loss

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
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )
        vocab = (
            cfg.model.vocab_size if cfg.reward_model is None else min(cfg.model.vocab_size, cfg.reward_model.vocab_size)
        )
        self.limits = Limits(cfg.server.max_batch_size, cfg.max_seq_len, vocab, cfg.server.max_train_batch_size)
        self.critic = TrainableModel(cfg.model, cfg.optim, head="scalar")
        if cfg.model.checkpoint:
            self.critic.load_weights(cfg.model.checkpoint, backbone_only=_is_lm_checkpoint(cfg.model.checkpoint))
        self.reward_model = None
        if cfg.reward_model is not None:
            self.reward_model = TrainableModel(cfg.reward_model, cfg.optim, head="scalar", trainable=False)
            if cfg.reward_model.checkpoint:
                dist_ckpt.load_model_weights(cfg.reward_model.checkpoint, [self.reward_model.module])
            else:
                LOG.warning("reward_model.checkpoint is not set: the reward model has random weights")
        # Loaded on every rank (a broken file fails everywhere at start-up), called on global rank 0 only.
        self.reward_function = RewardFunction(cfg.reward_fn, cfg.tokenizer_path) if cfg.reward_fn else None
        self.resumed_from = self._resume() if cfg.checkpoint.resume else None
        dist_ckpt.start_writer()  # not inside the first critic_save request

    # -- layout helpers ----------------------------------------------------------------------------------
    def _my_rows(self, batch: int) -> tuple[int, int]:
        return dp_rows(batch, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())

    @staticmethod
    def _contributes() -> bool:
        """One rank per data-parallel slice writes its rows into the all-reduced results."""
        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage(ignore_virtual=True)

    @staticmethod
    def _sum_over_world(t: torch.Tensor) -> torch.Tensor:
        if _world() > 1:
            dist.all_reduce(t)
        return t

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

        # One flat buffer: [values B*width | rewards B], summed over the world in one collective.
        out = torch.zeros(batch * width + batch, dtype=torch.float32, device=self.device)
        values_BT, rewards_B = out[: batch * width].view(batch, width), out[batch * width :]
        start, stop = self._my_rows(batch)
        if stop > start:  # a DP rank with no rows skips the forward (no collective spans DP in a forward pass)
            local = self._forward_values(self.critic, tokens_dev[start:stop])
            if self._contributes():
                values_BT[start:stop] = local
            if self.reward_model is not None:
                scores = self._forward_values(self.reward_model, tokens_dev[start:stop])
                if self._contributes():
                    last = (lengths_dev[start:stop] - 1).unsqueeze(1)
                    rm_B = scores.gather(1, last).squeeze(1)
                    rewards_B[start:stop] = (rm_B - self.cfg.reward_mean) / self.cfg.reward_std
        self._sum_over_world(out)
        values = torch.zeros(batch, seq, dtype=torch.float32)
        values[:, :width] = values_BT.cpu() * torch.from_numpy(valid_BT)
        if self.reward_function is not None:
            rewards = self._rewards_from_fn(tokens, lengths, prompt_lengths, labels)
        else:
            rewards = rewards_B.cpu()
        return values, rewards.reshape(batch, 1)

    def _forward_values(self, model, tokens_bT: torch.Tensor) -> torch.Tensor | None:
        """Scalar-head outputs [b, T] float32 for `tokens_bT` (None on pipeline stages other than the last)."""
        mbs = self.cfg.infer.micro_batch_size
        rows = tokens_bT.shape[0]
        padded = self._pad_rows(tokens_bT, mbs)  # equal micro-batch shapes, as the pipeline schedule requires
        micro = [{"tokens": padded[i : i + mbs]} for i in range(0, padded.shape[0], mbs)]
        outs = model.forward(micro, lambda batch, output: output.squeeze(-1).float())
        return torch.cat(outs)[:rows] if outs else None

    def _rewards_from_fn(self, tokens, lengths, prompt_lengths, labels) -> torch.Tensor:
        """Rank 0 runs the reward function; [ok, rewards...] is broadcast so every rank returns (or raises) alike."""
        batch = tokens.shape[0]
        packet = torch.zeros(batch + 1, dtype=torch.float64, device=self.device)
        error = None
        if _global_rank() == 0:
            try:
                packet[1:] = torch.from_numpy(self.reward_function(tokens, lengths, prompt_lengths, labels))
                packet[0] = 1.0
            except RewardFunctionError as exc:
                error = exc
        if _world() > 1:
            dist.broadcast(packet, src=0)
        if packet[0].item() != 1.0:
            raise error or RewardFunctionError("the reward function failed on rank 0 (see rank 0's error)")
        return packet[1:].to(torch.float32).cpu()

    # -- train -------------------------------------------------------------------------------------------
    def train(self, tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT) -> dict[str, float]:
        """Train the critic on one batch of rollouts; returns metrics (see protocol.TRAIN_METRICS)."""
        tokens, lengths, returns, prev_values, mask = check_train(
            tokens_BT, lengths_B, returns_BT, prev_values_BT, mask_BT, self.limits
        )
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
        sum_keys = ("vf_loss_sum", "vf_clipfrac_sum", "value_sum", "tokens")
        sums = torch.zeros(len(sum_keys), dtype=torch.float64, device=self.device)
        grad_norms, lr = [], 0.0
        for _ in range(cfg.epochs):
            for gb_start in range(0, batch, cfg.global_batch_size):
                gb_size = min(cfg.global_batch_size, batch - gb_start)
                lo, hi = (gb_start + r for r in self._my_rows(gb_size))
                micro = self._train_micro_batches(
                    tokens_dev[lo:hi], returns_dev[lo:hi], prev_dev[lo:hi], mask_dev[lo:hi], width
                )
                num_tokens = global_token_count([m["mask"] for m in micro], group=ps.get_data_parallel_group())
                metrics = self.critic.step(micro, partial(self._loss, num_tokens=num_tokens))
                if self._contributes():
                    sums += torch.tensor(
                        [metrics.get(k, 0.0) for k in sum_keys], dtype=torch.float64, device=self.device
                    )
                grad_norms.append(metrics["grad_norm"])
                lr = metrics["lr"]
        self._sum_over_world(sums)
        total = dict(zip(sum_keys, sums.tolist()))
        tokens_seen = total["tokens"]
        per_token = (lambda k: total[k] / tokens_seen) if tokens_seen else (lambda k: float("nan"))
        return {
            "loss": per_token("vf_loss_sum"),
            "value_clipfrac": per_token("vf_clipfrac_sum"),
            "grad_norm": float(np.mean(grad_norms)),
            "explained_variance": ev,
            "value_mean": per_token("value_sum"),
            "tokens": tokens_seen / cfg.epochs,
            "steps": float(len(grad_norms)),
            "lr": lr,
        }

    def _train_micro_batches(self, tokens, returns, prev_values, mask, width) -> list[dict]:
        mbs = self.cfg.train.micro_batch_size
        if tokens.shape[0] == 0:
            # This DP rank got no rows of a small global batch, but must still join the gradient all-reduce:
            # one all-padding micro-batch (mask 0) contributes exactly zero gradient.
            tokens = tokens.new_zeros((1, width))
            returns, prev_values, mask = (x.new_zeros((1, width)) for x in (returns, prev_values, mask))
        tensors = [self._pad_rows(x, mbs) for x in (tokens, returns, prev_values, mask)]
        return [
            dict(zip(("tokens", "returns", "prev_values", "mask"), (x[i : i + mbs] for x in tensors)))
            for i in range(0, tensors[0].shape[0], mbs)
        ]

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
        # TrainableModel.step sums metrics over micro-batches: pass the additive ones only.
        return loss, {k: v for k, v in stats.items() if not k.endswith("_max")}

    # -- checkpoints -------------------------------------------------------------------------------------
    def save(self, step) -> str:
        """Write `<checkpoint.dir>/step_<step>` (critic weights, optimizer, RNG); returns its path. Collective."""
        step = check_step(step)
        return dist_ckpt.save(
            self.cfg.checkpoint_dir,
            step,
            [self.critic.module],
            self.critic.optimizer,
            state={"optimizer_steps": self.critic.steps_taken, "job": "critic"},
            keep=self.cfg.checkpoint.keep,
            model_cfg=self.cfg.model,
        )

    def _resume(self) -> str | None:
        path = dist_ckpt.latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            LOG.warning("checkpoint.resume: no checkpoint under %s yet; starting fresh", self.cfg.checkpoint_dir)
            return None
        state = dist_ckpt.load(path, [self.critic.module], self.critic.optimizer)
        self.critic.steps_taken = int(state.get("optimizer_steps", 0))
        return path


def _is_lm_checkpoint(path: str) -> bool:
    """A policy (LM-head) checkpoint: the critic takes its backbone and keeps a fresh value head, as NeMo-Aligner's
    critic does when it starts from the SFT policy."""
    from aligner.checkpoint.convert import detect_model_type

    model_dir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
    if detect_model_type(model_dir) != "policy":
        return False
    LOG.warning("model.checkpoint %s holds an LM head: loading its backbone, the value head starts fresh", path)
    return True
