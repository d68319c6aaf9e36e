"""Supervised fine-tuning: next-token NLL on the response tokens of prompt/response or chat samples.

Data and targets: aligner.data.supervised.SFTDataset; micro-batches: aligner.data.packing (packed rows with
restarting positions and attention kept inside each sample, by the samples' starts or a block-diagonal mask as
`data.packed_attention` says, when `data.packing`; else length-bucketed samples). The loss is
the mean NLL over every target token of the global batch (aligner.rl.nll_loss, normalised by the job-wide token
count). The checkpoint is a policy checkpoint (LM head, `model.yaml`): the actor job takes it as `model.checkpoint`,
and scripts/convert_nemo_to_hf.py exports it as `*ForCausalLM`.

Metrics: `train/loss`, `train/grad_norm`, `train/lr`, `train/skipped_steps`, `train/tokens` (non-padding tokens),
`train/target_tokens`, `train/padding_fraction` (padding / all positions computed), `val/loss`; the loop adds
`train/tokens_per_s`.
"""

from __future__ import annotations

import logging
from functools import partial

import numpy as np
import torch

from aligner import rl
from aligner.config.errors import ConfigError
from aligner.config.sft import SFTJobConfig
from aligner.data.packing import collate, length_buckets, pack, packed_row, plain_row
from aligner.data.supervised import Sample, SFTDataset
from aligner.models.attention import flash_takes, varlen_check
from aligner.models.dtypes import torch_dtype
from aligner.models.gpt import resolve_attention_backend
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.training import TrainableModel
from aligner.parallel.device import current_device, on_gpu
from aligner.train.common import TaskBase

log = logging.getLogger(__name__)


def packed_attention(cfg: SFTJobConfig) -> str:
    """How packed rows keep attention inside each sample: 'varlen' (the samples' starts) or 'mask' (see
    aligner.config.sft). Where the flash kernel would run, it must first pass `varlen_check` on this GPU: `auto`
    falls back to the mask with a warning, `varlen` is refused."""
    choice = cfg.data.packed_attention
    dtype = torch_dtype(cfg.model.params_dtype)
    flash = flash_takes(on_gpu(), dtype, cfg.model.kv_channels)
    if choice == "mask" or (choice == "auto" and not flash):
        return "mask"
    if choice == "auto" and resolve_attention_backend(cfg.model.attention_backend) != "sdpa":
        return "mask"
    problem = varlen_check(current_device(), dtype) if flash else None
    if problem is None:
        return "varlen"
    if choice == "varlen":
        raise ConfigError(
            "data.packed_attention",
            f"varlen: PyTorch's flash varlen kernel failed its check here ({problem}); set mask",
        )
    log.warning(
        "data.packed_attention=auto: the flash varlen kernel failed its check (%s); packed rows use the mask", problem
    )
    return "mask"


class SFTTask(TaskBase):
    def __init__(self, cfg: SFTJobConfig):
        super().__init__(cfg)
        if cfg.data.packing and resolve_attention_backend(cfg.model.attention_backend) == "te":
            # Packed rows carry their block-diagonal mask as `attention_mask`, which Transformer Engine's causal
            # kernel does not read; SDPA and megatron's unfused attention do.
            raise ConfigError(
                "data.packing", "needs model.attention_backend=sdpa or unfused (here: te); or set data.packing=false"
            )
        self.packed_mask = cfg.data.packing and packed_attention(cfg) == "mask"
        if cfg.data.packing:
            log.info(
                "packed rows: attention kept inside each sample by %s",
                "a block-diagonal mask" if self.packed_mask else "the samples' starts (flash varlen kernel)",
            )
        self.train_data = SFTDataset(cfg.data.train_file, self.tokenizer, cfg.data)
        self.val_data = SFTDataset(cfg.data.val_file, self.tokenizer, cfg.data) if cfg.data.val_file else None
        self.model = TrainableModel(cfg.model, cfg.optim, head="lm")
        self.load_start_weights(self.model, head="lm")

    def num_examples(self) -> int:
        return len(self.train_data)

    # -- micro-batches -----------------------------------------------------------------------------------
    def micro_batches(self, samples: list[Sample], size: int) -> list[dict]:
        """`samples` as micro-batches of `size` rows: packed rows of up to data.max_length tokens, or samples of
        similar length (see the module docstring)."""
        if not samples:
            return []
        lengths = [len(s) for s in samples]
        if self.cfg.data.packing:
            rows = [packed_row([samples[i] for i in b]) for b in pack(lengths, self.cfg.data.max_length)]
            groups = [rows[i : i + size] for i in range(0, len(rows), size)]
        else:
            groups = [[plain_row(samples[i]) for i in g] for g in length_buckets(lengths, size)]
        if self.uniform_width:  # PP: one shape for every micro-batch; an empty row adds nothing to loss or gradient
            empty = Sample(np.array([self.tokenizer.pad_id]), np.array([False]))
            filler = packed_row([empty]) if self.cfg.data.packing else plain_row(empty)
            groups = [g + [filler] * (size - len(g)) for g in groups]
        widths = self.widths([[len(r["tokens"]) for r in g] for g in groups])
        pad = self.tokenizer.pad_id
        return [collate(g, w, pad, self.device, self.packed_mask) for g, w in zip(groups, widths, strict=True)]

    def _logprobs(self, batch: dict, logits_BTV: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logprobs(
            logits_BTV[:, :-1], batch["tokens"][:, 1:], self.tp_group, vocab_size=self.cfg.model.vocab_size
        )

    def _loss(self, batch: dict, logits_BTV: torch.Tensor, num_tokens: int):
        return rl.nll_loss(self._logprobs(batch, logits_BTV), batch["targets"][:, 1:], num_tokens)

    @staticmethod
    def _token_counts(samples: list[Sample], micro: list[dict]) -> dict:
        real = sum(len(s) for s in samples)
        return {"real": float(real), "computed": float(sum(mb["tokens"].numel() for mb in micro))}

    # -- step and validation -------------------------------------------------------------------------------
    def train_step(self, indices: list[int]) -> dict:
        samples = [self.train_data[i] for i in self.my_share(indices)]
        micro = self.micro_batches(samples, self.cfg.train.micro_batch_size)
        num_tokens = rl.global_token_count([mb["targets"][:, 1:] for mb in micro], group=self.dp_group)
        result = self.model.step(micro, partial(self._loss, num_tokens=num_tokens))
        stats = rl.reduce_stats(result["stats"], group=self.dp_group)
        counts = rl.sum_by_name(self._token_counts(samples, micro), group=self.dp_group)
        return {
            "train/loss": stats["nll"],
            "train/grad_norm": result["grad_norm"],
            "train/lr": result["lr"],
            "train/skipped_steps": float(result["skipped"]),
            "train/tokens": counts["real"],
            "train/target_tokens": stats["tokens"],
            "train/padding_fraction": 1.0 - counts["real"] / counts["computed"],
        }

    @torch.no_grad()
    def validate(self) -> dict:
        if self.val_data is None:
            return {}
        samples = [self.val_data[i] for i in self.my_validation_indices(len(self.val_data))]
        micro = self.micro_batches(samples, self.val_micro_batch_size)

        def sums(batch, logits_BTV):
            _, stats = rl.nll_loss(self._logprobs(batch, logits_BTV), batch["targets"][:, 1:], 1)
            return torch.stack([stats["nll_sum"], stats["tokens"]])

        # A rank with no validation rows (fewer rows than DP ranks) still joins the reduction, with zeros.
        zeros = torch.zeros(2, dtype=torch.float64, device=self.device)
        local = torch.stack(self.model.forward(micro, sums)).sum(0) if micro else zeros
        total = rl.sum_by_name({"nll": local[0], "tokens": local[1]}, group=self.dp_group)
        return {"val/loss": total["nll"] / total["tokens"] if total["tokens"] else float("nan")}
