"""What the three trainers' tasks share: the tokenizer, this rank's place in the data-parallel layout, which examples
it takes from a global batch, padding widths, and loading the starting weights.

A task (aligner.train.loop.Task) is built on every rank after `aligner.parallel.initialize`; every rank holds the
whole dataset (tokenised once) and takes a contiguous share of each global batch, so a step on DP ranks sees the
same examples as one process (tests/distributed/test_trainers_parallel.py).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner.checkpoint import dist_ckpt
from aligner.config.errors import ConfigError
from aligner.config.train import TrainJobConfig
from aligner.data.packing import collate_pairs, length_buckets
from aligner.data.supervised import Pair
from aligner.data.tokenizer import load_tokenizer
from aligner.models.training import TrainableModel
from aligner.parallel.device import current_device

log = logging.getLogger(__name__)


def share(n: int, parts: int, part: int) -> tuple[int, int]:
    """[start, stop) of `part`'s contiguous share of n items: sizes differ by at most one."""
    base, extra = divmod(n, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


class TaskBase:
    def __init__(self, cfg: TrainJobConfig):
        self.cfg = cfg
        self.dp = cfg.validate_world(dist.get_world_size())
        self.dp_rank, self.dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        # Under PP every micro-batch of a step must have one shape (TrainableModel); without it, each is padded to
        # its own longest row only.
        self.uniform_width = ps.get_pipeline_model_parallel_world_size() > 1
        self.device = current_device()
        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                "model.vocab_size",
                f"{cfg.model.vocab_size} is smaller than the tokenizer's {self.tokenizer.vocab_size} tokens: "
                "use the vocabulary size of the model the checkpoint was made from",
            )

    # -- which examples ----------------------------------------------------------------------------------
    def my_share(self, indices: list[int]) -> list[int]:
        """This DP rank's part of a global batch of dataset indices (every rank passes the same list)."""
        lo, hi = share(len(indices), self.dp, self.dp_rank)
        return indices[lo:hi]

    def my_validation_indices(self, size: int) -> list[int]:
        n = min(size, self.cfg.train.val_max_examples or size)
        return list(range(*share(n, self.dp, self.dp_rank)))

    @property
    def val_micro_batch_size(self) -> int:
        return self.cfg.train.val_micro_batch_size or self.cfg.train.micro_batch_size

    def widths(self, groups: list[list[int]]) -> list[int]:
        """Padding width per micro-batch from the lengths of its rows (one common width under PP)."""
        own = [max(g) for g in groups]
        return [max(own)] * len(own) if self.uniform_width and own else own

    def pair_micro_batches(self, pairs: list[Pair], size: int, indices: list[int] | None = None) -> list[dict]:
        """Preference pairs as micro-batches of up to `size` pairs of similar length (aligner.data.packing.
        collate_pairs: chosen rows, then rejected rows). `real` holds the number of pairs; under PP a short last
        micro-batch is filled up with copies of its last pair (one shape for the schedule), which `halves` drops.
        With `indices` (the pairs' dataset indices), `index` holds them per micro-batch."""
        groups = length_buckets([len(p) for p in pairs], size)
        real = [len(g) for g in groups]
        if self.uniform_width:
            groups = [g + [g[-1]] * (size - len(g)) for g in groups]
        widths = self.widths([[len(pairs[i]) for i in g] for g in groups])
        out = []
        for g, w, n in zip(groups, widths, real, strict=True):
            mb = collate_pairs([pairs[i] for i in g], w, self.tokenizer.pad_id, self.device)
            mb["real"] = n
            if indices is not None:
                mb["index"] = torch.tensor([indices[i] for i in g], dtype=torch.long, device=self.device)
            out.append(mb)
        return out

    @staticmethod
    def halves(mb: dict, values_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-row values of a pair micro-batch [2m] -> (chosen [real], rejected [real])."""
        m = values_R.shape[0] // 2
        return values_R[: mb["real"]], values_R[m : m + mb["real"]]

    # -- weights -----------------------------------------------------------------------------------------
    def load_start_weights(self, model: TrainableModel, head: str) -> None:
        """`model.checkpoint` into `model`: all of it when the heads agree; only the backbone when a scalar-head model
        starts from a policy (a reward model from the SFT checkpoint: its head starts fresh)."""
        path = self.cfg.model.checkpoint
        if not path:
            return
        if head == "scalar" and dist_ckpt.head_kind(path) == "lm":
            log.warning("model.checkpoint %s has an LM head: loading its backbone; the scalar head starts fresh", path)
            dist_ckpt.load_backbone_weights(path, [model.module])
        else:
            dist_ckpt.load_model_weights(path, [model.module])
        model.weights_loaded()

    def checkpoint_files(self) -> dict[str, str]:
        """Extra files written into each checkpoint (name -> text); collective (every rank calls it)."""
        return {}
