"""How a full (TP=1, PP=1) megatron GPT state dict maps onto one TP/PP rank's slice, and back.

Rules by parameter (megatron-core local/TE layer names):
- column-parallel, split on dim 0: word embeddings, output layer, linear_qkv weight/bias (heads are grouped per
  KV group, so contiguous chunks are whole groups), linear_fc1 bias/weight; with a gated MLP (the family's
  `gated_mlp`, e.g. SwiGLU) fc1 holds [gate; up] and each rank holds [gate_r; up_r], so gate and up are split
  separately;
- row-parallel, split on dim 1: linear_proj weight, linear_fc2 weight;
- everything else (norms, row-parallel biases, learned positions, a scalar head) is replicated.
PP: rank p holds global layers [p*L/PP, (p+1)*L/PP), renumbered from 0; embeddings on the first stage, final norm and
output layer on the last (and a copy of the embedding there when tied, as megatron does).
"""

from __future__ import annotations

import re

import torch

from aligner.families import family

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_COLUMN = (
    "embedding.word_embeddings.weight",
    "output_layer.weight",
    "linear_qkv.weight",
    "linear_qkv.bias",
    "linear_fc1.weight",
    "linear_fc1.bias",
)
_ROW = ("linear_proj.weight", "linear_fc2.weight")


def split_kind(name: str) -> str:
    if name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
        return "fc1"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def shard_tensor(name: str, full: torch.Tensor, tp_rank: int, tp: int, gated: bool) -> torch.Tensor:
    kind = split_kind(name)
    if tp == 1 or kind == "replicated":
        return full
    if kind == "fc1" and gated:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    dim = 1 if kind == "row" else 0
    return full.chunk(tp, dim=dim)[tp_rank]


def unshard_tensor(name: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    kind = split_kind(name)
    if len(shards) == 1 or kind == "replicated":
        return shards[0]
    if kind == "fc1" and gated:
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        return torch.cat([torch.cat(gates, 0), torch.cat(ups, 0)], 0)
    return torch.cat(shards, dim=1 if kind == "row" else 0)


def local_layer_range(num_layers: int, pp_rank: int, pp: int) -> range:
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def _pad_vocab(name: str, tensor: torch.Tensor, padded_vocab: int | None) -> torch.Tensor:
    if padded_vocab is None or not name.endswith(("word_embeddings.weight", "output_layer.weight")):
        return tensor
    if tensor.shape[0] > padded_vocab:
        raise ValueError(f"{name}: {tensor.shape[0]} rows exceed the padded vocabulary {padded_vocab}")
    return torch.cat([tensor, tensor.new_zeros(padded_vocab - tensor.shape[0], *tensor.shape[1:])], 0)


def shard_state_dict(
    full: dict,
    num_layers: int,
    gated: bool,
    tp_rank: int,
    tp: int,
    pp_rank: int = 0,
    pp: int = 1,
    tied: bool = False,
    padded_vocab: int | None = None,
) -> dict:
    """The slice of `full` that rank (tp_rank, pp_rank) holds, with local layer numbers.

    `full` holds the unpadded vocabulary; with `padded_vocab` the embedding and output rows are zero-padded to
    megatron's padded size for this TP before splitting.
    """
    full = {k: _pad_vocab(k, v, padded_vocab) for k, v in full.items()}
    layers = local_layer_range(num_layers, pp_rank, pp)
    first, last = pp_rank == 0, pp_rank == pp - 1
    out = {}
    for name, tensor in full.items():
        m = _LAYER.match(name)
        if m:
            idx = int(m.group(1))
            if idx not in layers:
                continue
            local = f"decoder.layers.{idx - layers.start}.{m.group(2)}"
            out[local] = shard_tensor(name, tensor, tp_rank, tp, gated)
            continue
        if name.startswith("embedding.") and not first:
            if tied and last and name == "embedding.word_embeddings.weight":
                out["output_layer.weight"] = shard_tensor(name, tensor, tp_rank, tp, gated)
            continue
        if (name.startswith("decoder.final_layernorm") or name.startswith("output_layer")) and not last:
            continue
        out[name] = shard_tensor(name, tensor, tp_rank, tp, gated)
    return out


def load_full_state_dict(module: torch.nn.Module, full: dict, model_cfg, strict: bool = True):
    """Copy a full, unpadded state dict into this rank's megatron module (TP/PP ranks from megatron's state)."""
    from megatron.core import parallel_state as ps

    from aligner.models.gpt import padded_vocab_size

    tp = ps.get_tensor_model_parallel_world_size()
    tied = model_cfg.tie_embeddings
    local = shard_state_dict(
        full,
        model_cfg.num_layers,
        family(model_cfg.arch).gated_mlp,
        ps.get_tensor_model_parallel_rank(),
        tp,
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        tied,
        padded_vocab_size(model_cfg.vocab_size, model_cfg.make_vocab_size_divisible_by, tp),
    )
    own = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    if tied and "output_layer.weight" not in own:
        local.pop("output_layer.weight", None)
    missing = sorted(set(own) - set(local))
    unexpected = sorted(set(local) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            if name not in local:
                continue
            src = local[name]
            if tuple(src.shape) != tuple(target.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(target.shape)}")
            target.copy_(src.to(target.dtype))


def full_state_dict(module: torch.nn.Module, model_cfg, grads: bool = False) -> dict:
    """Gather this model's full, unpadded state dict (collective over TP and PP; every rank gets it).

    With `grads`, the gradients (megatron's `main_grad` where DDP keeps them) instead of the weights.

    Meant for tests, conversion of small models and debugging; conversion of large models goes layer by layer.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    gated = family(model_cfg.arch).gated_mlp
    layers = local_layer_range(model_cfg.num_layers, ps.get_pipeline_model_parallel_rank(), pp)
    local = {}
    if grads:
        items = [
            (n, p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
            for n, p in module.named_parameters()
        ]
        items = [(n, g) for n, g in items if g is not None]
    else:
        items = list(module.state_dict().items())
    for name, t in items:
        if name.endswith("_extra_state"):
            continue
        if tp > 1 and split_kind(name) != "replicated":
            shards = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(shards, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = unshard_tensor(name, shards, gated)
        m = _LAYER.match(name)
        if m:
            name = f"decoder.layers.{int(m.group(1)) + layers.start}.{m.group(2)}"
        local[name] = t.detach().clone()
    if pp > 1:
        parts = [None] * pp
        dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
        merged = {}
        for part in parts:
            for k, v in part.items():
                merged.setdefault(k, v)
        local = merged
    if model_cfg.tie_embeddings:
        local.pop("output_layer.weight", None)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in local:
            local[name] = local[name][: model_cfg.vocab_size]
    return local
