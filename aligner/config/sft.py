"""The SFT job's config schema (`conf/sft.yaml`; shared sections: aligner/config/train.py).

Rows: `prompt` + `response` (plain text: BOS + prompt + response + EOS), or `messages` (a chat rendered with the
tokenizer's template); the loss covers the response (every assistant turn) only. With `data.packing`, several samples
share one row of `data.max_length` tokens (attention stays inside each sample, positions restart), and
`train.micro_batch_size` counts such rows; without it, micro-batches of samples of similar length (length
bucketing) are padded to their longest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from aligner.config.train import TrainDataConfig, TrainJobConfig, load_train_config


@dataclass
class SFTDataConfig(TrainDataConfig):
    response_key: str = "response"
    packing: bool = True


@dataclass
class SFTJobConfig(TrainJobConfig):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    exp_dir: str = "results/sft"

    @property
    def packs_rows(self) -> bool:
        return self.data.packing


def load_sft_config(argv: Sequence[str], default_name: str = "sft") -> SFTJobConfig:
    return load_train_config(SFTJobConfig, argv, default_name)
