"""The frozen reference policy, chosen once: `resident` (a second, frozen model on the device) or `swap` (the initial
weights kept in host memory and swapped into the policy for the reference forward, NeMo-Aligner's memory saver).

Both start from the policy's weights at construction time, so the KL to the reference is exactly 0 before the first
update. Contract: `forward(micro_batches, fn)` returns what `TrainableModel.forward` returns (on every rank).
"""

from __future__ import annotations

import torch

from aligner.config.schema import OptimConfig
from aligner.models.training import TrainableModel
from aligner.parallel.device import on_gpu


class ResidentReference:
    def __init__(self, model_cfg, policy: TrainableModel):
        self.model = TrainableModel(model_cfg, OptimConfig(), head="lm", trainable=False)
        self.model.module.load_state_dict(policy.module.state_dict())

    def forward(self, micro_batches, fn):
        return self.model.forward(micro_batches, fn)


class SwapReference:
    def __init__(self, policy: TrainableModel):
        self.policy = policy
        pin = on_gpu()
        self.host = {
            n: p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone()
            for n, p in policy.module.named_parameters()
        }
        # pinned as well: the policy's weights go out and back through here on every reference pass (pageable memory
        # would make both copies synchronous and several times slower)
        self.saved = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in self.host.items()}

    @torch.no_grad()
    def forward(self, micro_batches, fn):
        params = dict(self.policy.module.named_parameters())
        for n, p in params.items():  # policy weights out, reference weights in
            self.saved[n].copy_(p, non_blocking=True)
            p.copy_(self.host[n], non_blocking=True)
        try:
            return self.policy.forward(micro_batches, fn)
        finally:
            for n, p in params.items():
                p.copy_(self.saved[n], non_blocking=True)


def build_reference(mode: str, model_cfg, policy: TrainableModel):
    """The reference for `reference.mode` (validated at config load)."""
    return ResidentReference(model_cfg, policy) if mode == "resident" else SwapReference(policy)
