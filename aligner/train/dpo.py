"""Direct preference optimisation: the policy learns from (chosen, rejected) pairs against a frozen reference.

Each sequence's log-prob is the sum (or, with `dpo.average_logprobs`, the mean) of its response tokens' log-probs
(aligner.rl.sequence_logprobs); the loss is aligner.rl.dpo_loss (sigmoid with `dpo.beta` and
`dpo.label_smoothing`, or IPO), averaged over the pairs of the global batch. The reference is the policy's starting
weights (`model.checkpoint`, or the seeded initialisation), held per `dpo.reference`:
- `resident`: a frozen copy on the device (aligner.ppo.reference.ResidentReference), run on each micro-batch before
  the policy's step;
- `precomputed`: the reference log-probs of every training and validation pair, computed once by the policy itself
  before its first update (no second model in memory) and kept on every rank. A resumed run computes them again
  before the loop loads its checkpoint, i.e. from the same starting weights.
The checkpoint is a policy checkpoint (as SFT's).

Metrics: `train/loss`, `train/rewards_chosen`, `train/rewards_rejected` (implicit rewards beta (pi - ref)),
`train/reward_margin`, `train/accuracy` (chosen reward above rejected; 0 at the start, when policy == reference),
`train/grad_norm`, `train/lr`, `train/skipped_steps`, `train/tokens`; `val/loss`, `val/accuracy`,
`val/reward_margin`, `val/rewards_chosen`, `val/rewards_rejected`.
"""

from __future__ import annotations

from functools import partial

import torch

from aligner import rl
from aligner.config.dpo import DPOJobConfig
from aligner.data.supervised import PreferenceDataset
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.training import TrainableModel
from aligner.ppo.reference import ResidentReference
from aligner.rl._dist import all_reduce_
from aligner.train.common import TaskBase, share


class DPOTask(TaskBase):
    def __init__(self, cfg: DPOJobConfig):
        super().__init__(cfg)
        d = cfg.data
        self.train_data = PreferenceDataset(d.train_file, self.tokenizer, d)
        self.val_data = PreferenceDataset(d.val_file, self.tokenizer, d) if d.val_file else None
        self.model = TrainableModel(cfg.model, cfg.optim, head="lm")
        self.load_start_weights(self.model, head="lm")
        self.reference, self.reference_logps = None, {}
        if cfg.dpo.reference == "resident":
            self.reference = ResidentReference(cfg.model, self.model)
        else:
            self.reference_logps = {"train": self._precompute(self.train_data)}
            if self.val_data is not None:
                self.reference_logps["val"] = self._precompute(self.val_data)

    def num_examples(self) -> int:
        return len(self.train_data)

    # -- micro-batches and log-probs -----------------------------------------------------------------------
    def micro_batches(self, data: PreferenceDataset, indices: list[int], size: int) -> list[dict]:
        """Pairs `indices` of `data` as micro-batches; `index` keeps their dataset indices (precomputed reference)."""
        return self.pair_micro_batches([data[i] for i in indices], size, indices)

    def _sequence_logps(self, batch: dict, logits_BTV: torch.Tensor) -> torch.Tensor:
        """[2m] log-probs of the rows' responses (chosen rows first)."""
        logp_BS = vocab_parallel_logprobs(
            logits_BTV[:, :-1], batch["tokens"][:, 1:], self.tp_group, vocab_size=self.cfg.model.vocab_size
        )
        return rl.sequence_logprobs(logp_BS, batch["targets"][:, 1:], average=self.cfg.dpo.average_logprobs)

    @torch.no_grad()
    def _precompute(self, data: PreferenceDataset) -> torch.Tensor:
        """Reference log-probs [n, 2] (chosen, rejected) of every pair of `data`, on every rank: each DP rank runs
        its share, one all-reduce assembles them."""
        table = torch.zeros(len(data), 2, dtype=torch.float32, device=self.device)
        lo, hi = share(len(data), self.dp, self.dp_rank)
        micro = self.micro_batches(data, list(range(lo, hi)), self.val_micro_batch_size)
        if micro:
            for mb, logps in zip(micro, self.model.forward(micro, self._sequence_logps), strict=True):
                m = logps.shape[0] // 2  # copies that fill a PP micro-batch write the same values twice
                table[mb["index"]] = torch.stack([logps[:m], logps[m:]], dim=1).float()
        return all_reduce_(table, self.dp_group)

    def _attach_reference(self, micro: list[dict], split: str) -> None:
        """mb['reference'] = the reference's [2m] log-probs for each micro-batch."""
        if self.reference is not None:
            logps = self.reference.forward(micro, self._sequence_logps)
        else:
            table = self.reference_logps[split]
            logps = [torch.cat([table[mb["index"], 0], table[mb["index"], 1]]) for mb in micro]
        for mb, ref in zip(micro, logps, strict=True):
            mb["reference"] = ref

    def _loss(self, batch: dict, logits_BTV: torch.Tensor, num_pairs: int):
        policy = self._sequence_logps(batch, logits_BTV)
        ref = batch["reference"]
        m = policy.shape[0] // 2
        d = self.cfg.dpo
        return rl.dpo_loss(
            policy[:m], policy[m:], ref[:m], ref[m:], num_pairs, d.beta, d.label_smoothing, loss_type=d.loss
        )

    # -- step and validation -------------------------------------------------------------------------------
    def train_step(self, indices: list[int]) -> dict:
        mine = self.my_share(indices)
        micro = self.micro_batches(self.train_data, mine, self.cfg.train.micro_batch_size)
        self._attach_reference(micro, "train")
        result = self.model.step(micro, partial(self._loss, num_pairs=len(indices)))
        s = rl.reduce_stats(result["stats"], group=self.dp_group, count="pairs")
        tokens = sum(len(self.train_data[i].chosen) + len(self.train_data[i].rejected) for i in mine)
        return {
            "train/loss": s["loss"],
            "train/rewards_chosen": s["chosen"],
            "train/rewards_rejected": s["rejected"],
            "train/reward_margin": s["margin"],
            "train/accuracy": s["accuracy"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/skipped_steps": float(result["skipped"]),
            "train/tokens": rl.sum_by_name({"tokens": float(tokens)}, self.dp_group)["tokens"],
        }

    @torch.no_grad()
    def validate(self) -> dict:
        if self.val_data is None:
            return {}
        micro = self.micro_batches(
            self.val_data, self.my_validation_indices(len(self.val_data)), self.val_micro_batch_size
        )
        halves = {"policy": ([], []), "reference": ([], [])}  # (chosen parts, rejected parts)
        if micro:  # a rank without validation rows still joins the reduction below, with nothing
            self._attach_reference(micro, "val")
            for mb, policy in zip(micro, self.model.forward(micro, self._sequence_logps), strict=True):
                for name, x in (("policy", policy), ("reference", mb["reference"])):
                    chosen, rejected = self.halves(mb, x)
                    halves[name][0].append(chosen)
                    halves[name][1].append(rejected)
        pc, pr, rc, rr = (
            torch.cat(parts) if parts else torch.zeros(0, device=self.device)
            for name in ("policy", "reference")
            for parts in halves[name]
        )
        d = self.cfg.dpo
        _, stats = rl.dpo_loss(pc, pr, rc, rr, 1, d.beta, d.label_smoothing, loss_type=d.loss)
        s = rl.reduce_stats(stats, group=self.dp_group, count="pairs")
        return {
            "val/loss": s["loss"],
            "val/accuracy": s["accuracy"],
            "val/reward_margin": s["margin"],
            "val/rewards_chosen": s["chosen"],
            "val/rewards_rejected": s["rejected"],
        }
