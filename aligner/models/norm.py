"""The norms of megatron's local (non-Transformer-Engine) layer spec, usable with sequence parallelism.

megatron-core's `WrappedTorchNorm` (what the local spec uses without apex) refuses `sequence_parallel`: under
sequence parallelism each TP rank normalises only its slice of the sequence, so a norm's weight gradient is partial
on every rank and must be summed over the TP group. megatron's `finalize_model_grads` does that sum for every
parameter marked `sequence_parallel = True`; `TorchNorm` is torch's LayerNorm/RMSNorm with that mark, and is
otherwise the same module (fp32 parameters, the same names and state dict). Per-head q/k norms are marked too: their
gradients are partial per TP rank (each holds its own heads) and megatron sums them either way.

The weights stay fp32 (as megatron's fallback makes them), but a bf16 activation is normalised with the weight cast
to bf16 (what megatron computes with its bf16 module wrapper, and what the generation engine computes): torch's
norms take their fused kernel only when input and weight share a dtype. With an fp32 weight they ran the composite
path, casts and a dozen elementwise kernels per norm, about 15 % of a 1B model's training step on an H200
(docs/PERF.md). The cast is part of the graph, so gradients still reach the fp32 weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchNorm:
    """Builds torch.nn.LayerNorm or RMSNorm for megatron's spec (the signature megatron's build_module calls)."""

    def __new__(
        cls,
        config,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ):
        kinds = {"LayerNorm": _LayerNorm, "RMSNorm": _RMSNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma:
            raise NotImplementedError(f"TorchNorm: {config.normalization} (zero-centred gamma: not supported)")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _like(t: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    return t if t is None or t.dtype == x.dtype else t.to(x.dtype)


class _RMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, _like(self.weight, x), self.eps)


class _LayerNorm(torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, _like(self.weight, x), _like(self.bias, x), self.eps)
