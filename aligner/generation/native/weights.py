"""The native engine's own copy of this rank's policy shard, in megatron's training layout, and `refit`.

Layout (megatron-core local/TE layer names, this TP rank's slice; see aligner.models.sharding for the split rules):
- embedding.word_embeddings.weight [V_pad/TP, H] (vocab-parallel), embedding.position_embeddings.weight [P, H]
  (GPT-2 family, replicated);
- per layer: input_layernorm, self_attention.linear_qkv ([G/TP * (Hq/G + 2) * D, H], rows grouped per KV group:
  the group's query heads, then its key head, then its value head), self_attention.linear_proj ([H, Hq/TP * D],
  row-parallel), pre_mlp_layernorm, mlp.linear_fc1 ([gate; up] of this rank for SwiGLU), mlp.linear_fc2
  (row-parallel); biases where the family has them;
- decoder.final_layernorm, output_layer.weight [V_pad/TP, H] — absent with tied embeddings, where the output layer
  reads the embedding buffer (one buffer, refitted once).
Keeping the training layout is what makes refit a plain local `copy_` per tensor: the engine's TP layout is the
training TP layout (same ranks, same communicators), so refit moves no bytes between GPUs.

refit: every engine tensor is overwritten in place (`torch._foreach_copy_`, casting to the engine dtype); storage
pointers never change, so CUDA graphs captured over these buffers stay valid.
"""

from __future__ import annotations

import torch

_SUFFIXES = ("input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight", "self_attention.linear_proj.bias",
             "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias",
             "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
_GLOBAL = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
           "decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")


def unwrap_policy(policy) -> torch.nn.Module:
    """The bare megatron GPTModel inside a TrainableModel, a DDP wrapper or a list of model chunks."""
    if isinstance(policy, (list, tuple)):
        if len(policy) != 1:
            raise NotImplementedError("generation from virtual-pipeline model chunks is not supported: use one chunk")
        policy = policy[0]
    seen = 0
    while not hasattr(policy, "decoder") and hasattr(policy, "module") and seen < 4:
        policy = policy.module
        seen += 1
    if not hasattr(policy, "decoder"):
        raise TypeError(f"expected a megatron GPTModel (or a wrapper of one), got {type(policy).__name__}")
    return policy


def _policy_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(module.named_parameters())
    out = {}
    for name, tensor in named.items():
        if name in _GLOBAL or name.startswith("decoder.layers.") and name.endswith(_SUFFIXES):
            out[name] = tensor
        else:
            raise NotImplementedError(f"the native engine does not know the parameter {name!r} (e.g. QK layernorm, "
                                      "MoE): extend aligner/generation/native/weights.py and decoder.py")
    return out


class EngineWeights:
    """Engine-owned tensors named as the policy's parameters; `layer(i)` returns layer i's tensors by suffix."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        source = _policy_tensors(module)
        self.dtype = dtype
        self.tensors: dict[str, torch.Tensor] = {
            name: torch.empty(tuple(t.shape), dtype=dtype, device=device) for name, t in source.items()
        }
        self.num_layers = 1 + max(int(n.split(".")[2]) for n in self.tensors if n.startswith("decoder.layers."))
        self._layers = [{s: self.tensors.get(f"decoder.layers.{i}.{s}") for s in _SUFFIXES}
                        for i in range(self.num_layers)]
        self.refit(module)

    def refit(self, module: torch.nn.Module) -> None:
        """Copy the policy's current parameters into the engine's tensors, in place."""
        source = _policy_tensors(module)
        if source.keys() != self.tensors.keys():
            diff = sorted(set(source) ^ set(self.tensors))[:5]
            raise ValueError(f"the policy's parameters differ from those the engine was built from ({diff}): "
                             "refit needs the same model and parallel layout; rebuild the engine")
        dst, src = [], []
        for name, target in self.tensors.items():
            s = source[name].detach()
            if s.shape != target.shape:
                raise ValueError(f"refit: {name} has shape {tuple(s.shape)}, the engine holds {tuple(target.shape)}")
            dst.append(target)
            src.append(s if s.device == target.device else s.to(target.device))
        with torch.no_grad():
            torch._foreach_copy_(dst, src)

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def layer(self, i: int) -> dict[str, torch.Tensor | None]:
        """Layer i's tensors by suffix (None where the family has no such tensor); fixed for the engine's life."""
        return self._layers[i]

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight; the embedding's buffer itself when the embeddings are tied."""
        out = self.tensors.get("output_layer.weight")
        return out if out is not None else self.tensors["embedding.word_embeddings.weight"]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def data_ptrs(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.tensors.items()}
