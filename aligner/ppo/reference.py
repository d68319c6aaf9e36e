"""The frozen reference policy, chosen once: `resident` (a second, frozen model on the device) or `swap` (the initial
weights kept in host memory and swapped into the policy for the reference forward, NeMo-Aligner's memory saver).

Both start from the policy's weights at construction time, so the KL to the reference is exactly 0 before the first
update. Contract: `forward(policy, micro_batches, fn)` returns what `TrainableModel.forward` returns.
"""

from __future__ import annotations

import torch

from aligner.config.schema import OptimConfig


class ResidentReference:
    def __init__(self, model_cfg, policy_module):
        from aligner.models.training import TrainableModel

        self.model = TrainableModel(model_cfg, OptimConfig(), head="lm", trainable=False)
        self.model.module.load_state_dict(policy_module.state_dict())

    def forward(self, policy, micro_batches, fn):
        return self.model.forward(micro_batches, fn)


class SwapReference:
    def __init__(self, model_cfg, policy_module):
        pin = torch.cuda.is_available()
        self.host = {
            n: p.detach().to("cpu", copy=True).pin_memory() if pin else p.detach().clone()
            for n, p in policy_module.named_parameters()
        }
        self.saved = {n: torch.empty_like(t) for n, t in self.host.items()}

    @torch.no_grad()
    def forward(self, policy, micro_batches, fn):
        params = dict(policy.module.named_parameters())
        for n, p in params.items():  # policy weights out, reference weights in
            self.saved[n].copy_(p, non_blocking=True)
            p.copy_(self.host[n], non_blocking=True)
        try:
            return policy.forward(micro_batches, fn)
        finally:
            for n, p in params.items():
                p.copy_(self.saved[n], non_blocking=True)


def build_reference(mode: str, model_cfg, policy_module):
    if mode == "resident":
        return ResidentReference(model_cfg, policy_module)
    if mode == "swap":
        return SwapReference(model_cfg, policy_module)
    raise ValueError(f"reference.mode={mode!r}: use resident or swap")
