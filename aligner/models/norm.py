"""The norms of megatron's local (non-Transformer-Engine) layer spec, usable with sequence parallelism.

megatron-core's `WrappedTorchNorm` (what the local spec uses without apex) refuses `sequence_parallel`: under
sequence parallelism each TP rank normalises only its slice of the sequence, so a norm's weight gradient is partial
on every rank and must be summed over the TP group. megatron's `finalize_model_grads` does that sum for every
parameter marked `sequence_parallel = True`; `TorchNorm` is torch's LayerNorm/RMSNorm with that mark, and is
otherwise the same module (fp32 parameters, the same names and state dict). Per-head q/k norms are marked too: their
gradients are partial per TP rank (each holds its own heads) and megatron sums them either way.
"""

from __future__ import annotations

import torch


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
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds or config.layernorm_zero_centered_gamma:
            raise NotImplementedError(f"TorchNorm: {config.normalization} (zero-centred gamma: not supported)")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm
