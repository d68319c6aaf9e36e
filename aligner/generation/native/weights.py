"""The native engine's own copy of this rank's policy shard, in megatron's training layout, and `refit`.

Layout (megatron-core local/TE layer names, this TP rank's slice; see aligner.models.sharding for the split rules):
- embedding.word_embeddings.weight [V_pad/TP, H] (vocab-parallel), embedding.position_embeddings.weight [P, H]
  (GPT-2 family, replicated);
- per layer: input_layernorm, self_attention.linear_qkv ([G/TP * (Hq/G + 2) * D, H], rows grouped per KV group:
  the group's query heads, then its key head, then its value head), self_attention.q_layernorm / k_layernorm ([D],
  replicated; Qwen3), self_attention.linear_proj ([H, Hq/TP * D],
  row-parallel), pre_mlp_layernorm, mlp.linear_fc1 ([gate; up] of this rank for SwiGLU), mlp.linear_fc2
  (row-parallel); biases where the family has them;
- decoder.final_layernorm, output_layer.weight [V_pad/TP, H] — absent with tied embeddings, where the output layer
  reads the embedding buffer (one buffer, refitted once).
Keeping the training layout is what makes refit a plain local `copy_` per tensor: the engine's TP layout is the
training TP layout (same ranks, same communicators), so refit moves no bytes between GPUs.

Pipeline parallelism (NeMo-Aligner's "reshard"): with PP > 1 every rank of a pipeline group holds the engine's copy
of *all* layers of its TP shard (layers named by their global index), so each rank can generate on its own; the
pipeline group's ranks then generate the same tokens. At build time the stages exchange a manifest (names, shapes);
refit copies this stage's own tensors locally and broadcasts each stage's tensors from that stage over the static
pipeline communicator, into the same buffers.

refit: every engine tensor is overwritten in place (`torch._foreach_copy_`, casting to the engine dtype, then the
pipeline broadcasts); storage pointers never change, so CUDA graphs captured over these buffers stay valid.

Shared weights (`generation.share_weights`, the default `auto`): at PP=1 the engine's layout *is* the policy's, so
where the engine's dtype and device are the policy parameters' own (bf16 training on GPU, fp32 on CPU) the engine
holds the policy's tensors themselves (detached views of the same storage): nothing is copied, there is no second
copy of the weights in memory (7.5 GB per GPU for an 8B policy at TP=2), and `refit` only checks that the policy's
storage has not moved (megatron's optimizer writes the new weights into the same buffers every step) and copies the
few vectors of another dtype (megatron's norms are fp32 parameters in a bf16 model without apex/TE). Where the storage
has moved (something re-assigned `param.data`), refit re-points the engine and reports it, so captured graphs are
dropped. With PP > 1, weight matrices of another dtype or another device the copy above is used (`on` then refuses,
naming the reason).
"""

from __future__ import annotations

import torch

_SUFFIXES = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
)
_GLOBAL = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)


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


def _layer_offset(module: torch.nn.Module) -> int:
    """Global index of this pipeline stage's first layer (megatron numbers its layers globally from 1)."""
    layers = module.decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def _policy_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameters by engine name: layers renamed to their global index (the same names at PP=1)."""
    offset = _layer_offset(module)
    out = {}
    for name, tensor in module.named_parameters():
        if name in _GLOBAL:
            out[name] = tensor
        elif name.startswith("decoder.layers.") and name.endswith(_SUFFIXES):
            _, _, local, rest = name.split(".", 3)
            out[f"decoder.layers.{int(local) + offset}.{rest}"] = tensor
        else:
            raise NotImplementedError(
                f"the native engine does not know the parameter {name!r} (e.g. MoE): extend "
                "aligner/generation/native/weights.py and decoder.py"
            )
    return out


def _why_not_shared(source: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device, pp_group) -> str:
    """'' when the engine can read the policy's weight matrices themselves, else the reason it needs a copy. (Vectors
    of another dtype, such as megatron's fp32 norms in a bf16 model without apex/TE, are copied either way.)"""
    if pp_group is not None:
        return "with pipeline parallelism every rank holds all layers (a copy)"
    for name, t in source.items():
        if t.device != device:
            return f"the policy's {name} is on {t.device}, the engine on {device}"
        if t.dim() >= 2 and t.dtype != dtype:
            return f"the engine's dtype {dtype} differs from the policy's {t.dtype} ({name}; see generation.dtype)"
    return ""


class EngineWeights:
    """Engine-owned tensors named as the policy's parameters; `layer(i)` returns layer i's tensors by suffix.

    `pp_group`: the pipeline-parallel communicator when PP > 1 (every rank then holds all layers; see above)."""

    def __init__(
        self, module: torch.nn.Module, dtype: torch.dtype, device: torch.device, pp_group=None, share: str = "off"
    ):
        source = _policy_tensors(module)
        self.dtype = dtype
        self.pp_group = pp_group
        why_not = _why_not_shared(source, dtype, device, pp_group)
        if share == "on" and why_not:
            raise ValueError(f"generation.share_weights=on is not possible here: {why_not}; use auto or off")
        self.shared = share != "off" and not why_not
        self.why_copied = "generation.share_weights=off" if share == "off" else why_not
        self._own = sorted(source)
        # shared: the tensors read in place; the rest (all, or only vectors of another dtype) are copied by refit
        self._copied = [n for n in self._own if not (self.shared and source[n].dtype == dtype)]
        shapes = {name: tuple(t.shape) for name, t in source.items()}
        self._owner: dict[str, int] = {}  # name -> global rank that broadcasts it (PP > 1)
        if pp_group is not None:
            import torch.distributed as dist

            manifests = [None] * dist.get_world_size(pp_group)
            dist.all_gather_object(manifests, (dist.get_rank(), shapes), group=pp_group)
            shapes = {}
            for rank, stage_shapes in manifests:
                for name, shape in stage_shapes.items():
                    if name in self._owner:
                        raise ValueError(f"two pipeline stages hold {name!r}: the engine cannot tell which is current")
                    self._owner[name], shapes[name] = rank, shape
        self._index(
            {
                name: source[name].detach()
                if name in source and name not in self._copied
                else torch.empty(shape, dtype=dtype, device=device)
                for name, shape in shapes.items()
            }
        )
        self.refit(module)

    def _index(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(sorted(tensors.items()))
        self.num_layers = 1 + max(int(n.split(".")[2]) for n in self.tensors if n.startswith("decoder.layers."))
        self._layers = [
            {s: self.tensors.get(f"decoder.layers.{i}.{s}") for s in _SUFFIXES} for i in range(self.num_layers)
        ]

    def refit(self, module: torch.nn.Module) -> bool:
        """Copy the policy's current parameters into the engine's tensors, in place (collective over the pipeline
        group when PP > 1). Shared weights: nothing to copy; returns True when the policy's storage had moved and the
        engine now points at the new one (graphs captured over the old addresses must be dropped)."""
        source = _policy_tensors(module)
        if sorted(source) != self._own:
            diff = sorted(set(source) ^ set(self._own))[:5]
            raise ValueError(
                f"the policy's parameters differ from those the engine was built from ({diff}): "
                "refit needs the same model and parallel layout; rebuild the engine"
            )
        moved = False
        if self.shared:
            read = [n for n in self._own if n not in self._copied]
            moved = any(source[n].data_ptr() != self.tensors[n].data_ptr() for n in read)
            if moved:
                if any(source[n].dtype != self.dtype or source[n].device != self.tensors[n].device for n in read):
                    raise ValueError("refit: the policy's parameters changed dtype or device; rebuild the engine")
                self._index({**self.tensors, **{n: source[n].detach() for n in read}})
        dst, src = [], []
        for name in self._copied:
            s, target = source[name].detach(), self.tensors[name]
            if s.shape != target.shape:
                raise ValueError(f"refit: {name} has shape {tuple(s.shape)}, the engine holds {tuple(target.shape)}")
            dst.append(target)
            src.append(s if s.device == target.device else s.to(target.device))
        with torch.no_grad():
            if dst:
                torch._foreach_copy_(dst, src)
            if self.pp_group is not None:
                import torch.distributed as dist

                for name, target in self.tensors.items():  # the same order on every rank (sorted names)
                    dist.broadcast(target, src=self._owner[name], group=self.pp_group)
        return moved

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
        """Bytes of weights one forward reads (shared or not)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def owned_nbytes(self) -> int:
        """Bytes the engine holds on top of the policy (with shared weights: the copied vectors, if any)."""
        return sum(self.tensors[n].numel() * self.tensors[n].element_size() for n in self._copied if n in self.tensors)

    def data_ptrs(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.tensors.items()}
