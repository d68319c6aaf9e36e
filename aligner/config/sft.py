"""The SFT job's config schema (`conf/sft.yaml`; shared sections: aligner/config/train.py).

Rows: `prompt` + `response` (plain text: BOS + prompt + response + EOS), or `messages` (a chat rendered with the
tokenizer's template); the loss covers the response (every assistant turn) only. With `data.packing`, several samples
share one row of `data.max_length` tokens (attention stays inside each sample, positions restart), and
`train.micro_batch_size` counts such rows; without it, micro-batches of samples of similar length (length
bucketing) are padded to their longest. `data.packed_attention` says how packed rows keep attention inside each
sample: `varlen` by the samples' starts (a variable-length flash kernel on GPUs: each sample's own causal block, no
mask), `mask` by a dense [T, T] block-diagonal mask per row (any attention core; the whole T x T score matrix);
`auto`: varlen where the flash kernel runs (GPU, bf16/fp16 parameters, the SDPA core) and passes its start-up check
(aligner.models.attention.varlen_check), else mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

from aligner.config.rules import check
from aligner.config.train import TrainDataConfig, TrainJobConfig, load_train_config


@dataclass
class SFTDataConfig(TrainDataConfig):
    response_key: str = "response"
    packing: bool = True
    packed_attention: Literal["auto", "varlen", "mask"] = "auto"  # varlen: flash by samples | mask: dense | auto


@dataclass
class SFTJobConfig(TrainJobConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    exp_dir: str = "results/sft"

    def validate(self) -> None:
        super().validate()
        backend = self.model.attention_backend
        check(
            not (self.data.packing and self.data.packed_attention == "varlen" and backend in ("unfused", "te")),
            "data.packed_attention",
            f"varlen needs model.attention_backend=sdpa or auto (here: {backend}); or set it to mask",
        )

    @property
    def packs_rows(self) -> bool:
        return self.data.packing


def load_sft_config(argv: Sequence[str], default_name: str = "sft") -> SFTJobConfig:
    return load_train_config(SFTJobConfig, argv, default_name)
