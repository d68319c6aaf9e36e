"""Reward-model training: a scalar-head GPT scored at each sequence's last token, Bradley-Terry loss on pairs.

The score of a sequence of length n is the head's output at position n - 1, exactly what the critic job reads
(`CriticService.infer`, position `lengths - 1`), so the checkpoint serves as the critic's `reward_model.checkpoint`
unchanged. The head's bias is frozen at 0: the Bradley-Terry loss only sees score differences, so the bias gets no
useful gradient (only rounding noise, which Adam would amplify), and HF's `*ForSequenceClassification` score layer
has no bias, so the export (scripts/convert_nemo_to_hf.py) gives identical scores.

Every checkpoint carries `reward_stats.json`: {"reward_mean", "reward_std", "count", "file"}, the mean and standard
deviation of the model's rewards on the chosen and rejected responses of the first `reward_stats.max_examples`
pairs of `reward_stats.file` (default: the training file). The critic job standardises rewards with them when
its config leaves `reward_mean` / `reward_std` unset.

Metrics: `train/loss`, `train/accuracy` (chosen scored above rejected), `train/reward_margin`,
`train/reward_chosen`, `train/reward_rejected`, `train/grad_norm`, `train/lr`, `train/skipped_steps`,
`train/tokens`; `val/loss`, `val/accuracy`, `val/reward_margin`, `val/reward_chosen`, `val/reward_rejected`.
"""

from __future__ import annotations

import json
import math
from functools import partial

import torch

from aligner import rl
from aligner.config.critic import REWARD_STATS_FILE
from aligner.config.reward_model import RewardModelJobConfig
from aligner.data.supervised import Pair, PreferenceDataset
from aligner.models.training import TrainableModel
from aligner.train.common import TaskBase, share


def last_token_scores(batch: dict, output_BT1: torch.Tensor) -> torch.Tensor:
    """Scores [2m] (float32): the head's output at each row's last token."""
    return output_BT1.squeeze(-1).float().gather(1, (batch["lengths"] - 1).unsqueeze(1)).squeeze(1)


class RewardModelTask(TaskBase):
    def __init__(self, cfg: RewardModelJobConfig):
        super().__init__(cfg)
        d = cfg.data
        self.train_data = PreferenceDataset(d.train_file, self.tokenizer, d)
        self.val_data = PreferenceDataset(d.val_file, self.tokenizer, d) if d.val_file else None
        stats_file = cfg.reward_stats.file or d.train_file
        self.stats_data = self.train_data if stats_file == d.train_file else None
        self.stats_file = stats_file
        self.model = TrainableModel(cfg.model, cfg.optim, head="scalar", frozen=("output_layer.bias",))
        self.load_start_weights(self.model, head="scalar")

    def num_examples(self) -> int:
        return len(self.train_data)

    def _loss(self, batch: dict, output_BT1: torch.Tensor, num_pairs: int):
        scores = last_token_scores(batch, output_BT1)
        m = scores.shape[0] // 2
        return rl.bradley_terry_loss(scores[:m], scores[m:], num_pairs)

    def train_step(self, indices: list[int]) -> dict:
        pairs = [self.train_data[i] for i in self.my_share(indices)]
        micro = self.pair_micro_batches(pairs, self.cfg.train.micro_batch_size)
        result = self.model.step(micro, partial(self._loss, num_pairs=len(indices)))
        stats = rl.reduce_stats(result["stats"], group=self.dp_group, count="pairs")
        tokens = rl.sum_by_name({"tokens": float(sum(len(p.chosen) + len(p.rejected) for p in pairs))}, self.dp_group)
        return {
            "train/loss": stats["loss"],
            "train/accuracy": stats["accuracy"],
            "train/reward_margin": stats["margin"],
            "train/reward_chosen": stats["chosen"],
            "train/reward_rejected": stats["rejected"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/skipped_steps": float(result["skipped"]),
            "train/tokens": tokens["tokens"],
        }

    def scores(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rewards (chosen [n], rejected [n]) of this rank's `pairs`, float32 on the device. Collective."""
        micro = self.pair_micro_batches(pairs, self.val_micro_batch_size)
        if not micro:
            empty = torch.zeros(0, device=self.device)
            return empty, empty
        halves = [self.halves(mb, o) for mb, o in zip(micro, self.model.forward(micro, last_token_scores), strict=True)]
        return torch.cat([c for c, _ in halves]), torch.cat([r for _, r in halves])

    @torch.no_grad()
    def validate(self) -> dict:
        if self.val_data is None:
            return {}
        chosen, rejected = self.scores([self.val_data[i] for i in self.my_validation_indices(len(self.val_data))])
        _, stats = rl.bradley_terry_loss(chosen, rejected, 1)
        r = rl.reduce_stats(stats, group=self.dp_group, count="pairs")
        return {
            "val/loss": r["loss"],
            "val/accuracy": r["accuracy"],
            "val/reward_margin": r["margin"],
            "val/reward_chosen": r["chosen"],
            "val/reward_rejected": r["rejected"],
        }

    @torch.no_grad()
    def reward_stats(self) -> dict:
        """Mean and std of the rewards on `reward_stats.file` (see the module docstring), the same on every rank."""
        if self.stats_data is None:  # loaded on first use: a job that never checkpoints never reads it
            self.stats_data = PreferenceDataset(self.stats_file, self.tokenizer, self.cfg.data)
        n = min(len(self.stats_data), self.cfg.reward_stats.max_examples)
        lo, hi = share(n, self.dp, self.dp_rank)
        chosen, rejected = self.scores([self.stats_data[i] for i in range(lo, hi)])
        rewards = torch.cat([chosen, rejected]).double()
        s = rl.sum_by_name(
            {"count": float(rewards.numel()), "sum": rewards.sum(), "sum_sq": (rewards**2).sum()}, group=self.dp_group
        )
        mean = s["sum"] / s["count"]
        std = math.sqrt(max(0.0, s["sum_sq"] / s["count"] - mean**2))
        # A constant reward model (std 0) would divide by zero in the critic: report std 1 (no scaling) instead.
        std = std if std > 0 else 1.0
        return {"reward_mean": mean, "reward_std": std, "count": int(s["count"]), "file": self.stats_file}

    def checkpoint_files(self) -> dict[str, str]:
        return {REWARD_STATS_FILE: json.dumps(self.reward_stats(), indent=1) + "\n"}
