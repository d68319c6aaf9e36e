"""Hugging Face <-> megatron-core mappings: configs and weights, tensor by tensor (no model, no I/O here).

Supported HF architectures (`SUPPORTED`) are those the family specs list (aligner.families): the Llama
family (Llama 2/3/3.x with llama3 RoPE scaling, Mistral, Qwen2 with its q/k/v biases, Qwen3 with its per-head q/k
norms and head_dim) and GPT-2, each as a causal LM (`policy`) or as
`*ForSequenceClassification` with one label (`reward`, the `score` head). Everything family-specific (config.json
keys, what megatron cannot express, tensor names and layouts) is read off the spec; this module holds the generic
rules.

Contract:
- `model_config_from_hf(hf_cfg)` -> (ModelConfig, family, model_type) checks every field megatron cannot express
  (rope scaling, sliding windows, biases, head_dim, activations) and raises `UnsupportedModelError` naming it;
  `hf_config_for_export(model_cfg, model_type, source)` is the reverse (exact when the source config is kept).
- `weight_map(cfg, model_type)` returns a `WeightMap` whose `parts()` are "pre" (embeddings), the layer
  indices 0..L-1 and "post" (final norm, output layer / score head). `to_megatron(part, read)` maps one part's HF
  tensors (fetched lazily through `read(hf_name)`) to *full* megatron tensors: TP=1 names (local layer spec, global
  layer numbers) with the unpadded vocabulary, the canonical form of aligner.models.sharding. `to_hf(part, read)`
  is the exact inverse (`read(megatron_name)`). Both only permute, transpose, split and concatenate, so a round
  trip is bit-identical. Callers stream part by part, so at most one layer is held twice.
- megatron's fused QKV (per KV group g: the q heads of g, then k_g, then v_g, each head `kv_channels` wide) and
  gated fc1 ([gate; up]) are the only non-trivial layouts; Qwen3's q/k norms map one to one; HF's q/k/v come as
  three tensors (Llama) or one [q | k | v] (GPT-2), and Conv1D weights (GPT-2) are stored [in, out] and are
  transposed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

import torch

from aligner.checkpoint.dist_ckpt import CheckpointMismatchError
from aligner.config.schema import ModelConfig
from aligner.families import FamilySpec, HFVariant, UnsupportedModelError, families, family
from aligner.families.spec import (
    LLAMA3_ROPE_KEYS,
    LONGROPE_FIELDS,
    hf_rope,
    longrope_numbers,
    nope_layers,
    partial_rotary_factor,
)
from aligner.families.spec import hf_get as _get

Read = Callable[[str], torch.Tensor]

# HF architecture -> (family, model type)
SUPPORTED = {
    arch: (spec.name, model_type)
    for spec in families()
    for variant in spec.hf.variants
    for arch, model_type in ((variant.causal_lm, "policy"), (variant.classifier, "reward"))
}
MODEL_TYPES = ("policy", "reward")


def architecture_of(hf_cfg) -> str:
    archs = _get(hf_cfg, "architectures") or []
    if len(archs) != 1:
        raise UnsupportedModelError(
            f"config.json 'architectures' is {archs!r}: expected exactly one of {sorted(SUPPORTED)}"
        )
    if archs[0] not in SUPPORTED:
        raise UnsupportedModelError(
            f"architecture {archs[0]!r} (config.json 'architectures') is not supported; supported: {sorted(SUPPORTED)}"
        )
    return archs[0]


def normalized_hf_config(raw: dict) -> dict:
    """config.json with transformers' defaults filled in (and legacy rope fields normalised) for the checks."""
    from transformers import AutoConfig

    architecture_of(raw)  # a clear error before transformers meets an unknown model_type
    kwargs = {k: v for k, v in raw.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(raw.get("model_type"), **kwargs).to_dict()
    except _config_errors() as exc:  # an unknown model_type, or a field its config class validates and rejects
        raise UnsupportedModelError(
            f"config.json (model_type {raw.get('model_type')!r}) is rejected by transformers: "
            + " ".join(str(exc).split())
        ) from exc


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers raises for a config.json it cannot take: ValueError / KeyError, and huggingface_hub's
    strict-dataclass validation errors (transformers 5: e.g. a RoPE factor list of the wrong length)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a huggingface_hub before strict dataclasses
        return (ValueError, KeyError)
    return (ValueError, KeyError, StrictDataclassError)


def _variant(spec: FamilySpec, hf_cfg, arch: str) -> HFVariant:
    model_type_hf = _get(hf_cfg, "model_type")
    variant = spec.hf.variant_of_type(model_type_hf)
    if variant is None:
        expected = tuple(v.model_type for v in spec.hf.variants)
        raise UnsupportedModelError(
            f"config.json 'model_type' = {model_type_hf!r} with architecture {arch}: expected one of {expected}"
        )
    return variant


def model_config_from_hf(
    hf_cfg, params_dtype: str = "float32", max_position_embeddings: int | None = None
) -> tuple[ModelConfig, str, str]:
    """ModelConfig for an HF config (a transformers config object or the config.json dict).

    Returns (model_cfg, family, model_type). `max_position_embeddings` may only lower the HF value (the cap that
    makes a long sliding window exact); learned positions cannot change.
    """
    arch = architecture_of(hf_cfg)
    family_name, model_type = SUPPORTED[arch]
    spec = family(family_name)
    if model_type == "reward":
        labels = _get(hf_cfg, "num_labels", len(_get(hf_cfg, "id2label", None) or {0: 0}))
        if labels != 1:
            raise UnsupportedModelError(
                f"{arch} with num_labels={labels}: a reward model has exactly one label (one score per sequence)"
            )
    variant = _variant(spec, hf_cfg, arch)
    keys = dict(spec.hf.config_keys)
    max_pos_key = keys["max_position_embeddings"]
    hf_max_pos = _get(hf_cfg, max_pos_key)
    if max_position_embeddings is not None and not spec.rope and max_position_embeddings != hf_max_pos:
        raise UnsupportedModelError(
            f"--max-position-embeddings cannot change {arch}'s learned positions ({max_pos_key}={hf_max_pos})"
        )
    if max_position_embeddings is not None and max_position_embeddings > hf_max_pos:
        raise UnsupportedModelError(
            f"--max-position-embeddings {max_position_embeddings} exceeds the model's {max_pos_key}={hf_max_pos}"
        )
    if max_position_embeddings is None:
        spec.hf.check_config(hf_cfg, variant)
    else:
        capped = dict(hf_cfg if isinstance(hf_cfg, dict) else hf_cfg.to_dict())
        capped[max_pos_key] = max_position_embeddings
        spec.hf.check_config(capped, variant)
    fields = {field: _get(hf_cfg, key) for field, key in spec.hf.config_keys}
    heads = fields["num_attention_heads"]
    if "num_query_groups" in fields:
        fields["num_query_groups"] = fields["num_query_groups"] or heads
    else:
        fields["num_query_groups"] = None  # one KV head per query head
    fields["ffn_hidden_size"] = fields["ffn_hidden_size"] or 4 * fields["hidden_size"]
    if fields.get("head_dim") == fields["hidden_size"] // heads:
        fields["head_dim"] = None  # the default width: model.yaml says so by leaving it out
    fields["max_position_embeddings"] = max_position_embeddings or hf_max_pos
    fields["tie_embeddings"] = bool(_get(hf_cfg, keys["tie_embeddings"], spec.tie_embeddings))
    fields["init_method_std"] = _get(hf_cfg, keys["init_method_std"], ModelConfig.init_method_std)
    if spec.rope:
        fields["rotary_base"], rope_type, params = hf_rope(hf_cfg)
        fields["rotary_percent"] = partial_rotary_factor(hf_cfg, params)  # check_config: 1, or a variant's own
        if rope_type == "llama3":  # check_config accepted it: all four numbers are there
            fields["rope_scaling"] = "llama3"
            for key, field in LLAMA3_ROPE_KEYS:
                fields[field] = type(getattr(ModelConfig, field))(params[key])
        if rope_type == "longrope":  # the same: both factor lists and the pre-training context are there
            fields["rope_scaling"] = "longrope"
            original, attention = longrope_numbers(hf_cfg, params)
            fields["rope_scaling_original_max_position_embeddings"] = original
            fields["rope_scaling_attention_factor"] = attention
            fields["rope_scaling_short_factor"] = [float(x) for x in params["short_factor"]]
            fields["rope_scaling_long_factor"] = [float(x) for x in params["long_factor"]]
        if variant.nope:  # SmolLM3: check_config saw one entry per layer
            fields["nope_layers"] = nope_layers(hf_cfg)
    cfg = ModelConfig(
        arch=spec.name,
        add_qkv_bias=variant.qkv_bias,
        qk_layernorm=variant.qk_layernorm,
        params_dtype=params_dtype,
        **fields,
    )
    return cfg, spec.name, model_type


def hf_architecture(cfg: ModelConfig, model_type: str, source: dict | None = None) -> str:
    """The HF class to export to: the source's variant (Llama/Mistral/Qwen2/GPT-2) with the head of `model_type`."""
    hf = family(cfg.arch).hf
    if source and _get(source, "architectures"):
        source_arch = architecture_of(source)
        variant = hf.variant_of_architecture(source_arch)
        if variant is None:
            raise CheckpointMismatchError(
                f"hf_config.json describes a {source_arch}, not a {cfg.arch}-family model as model.yaml does"
            )
    else:
        variant = hf.export_variant(cfg.add_qkv_bias, cfg.qk_layernorm, bool(cfg.nope_layers))
    return variant.causal_lm if model_type == "policy" else variant.classifier


def hf_config_for_export(cfg: ModelConfig, model_type: str, source: dict | None, dtype: str) -> dict:
    """config.json for the exported model: the source config (exact) or one built from `cfg`, with the head's
    architecture, one label for reward models and the export dtype."""
    arch = hf_architecture(cfg, model_type, source)
    if source is None:
        source = _config_from_model(cfg)
    out = dict(source)
    out["architectures"] = [arch]
    if model_type == "reward":
        out.pop("num_labels", None)
        out["id2label"], out["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    else:
        for key in ("num_labels", "id2label", "label2id", "problem_type"):
            out.pop(key, None)
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype
    out["dtype"] = dtype
    # A config built from the model must describe it; a kept source config must agree with it.
    check, _, _ = model_config_from_hf(
        normalized_hf_config(out), cfg.params_dtype, cfg.max_position_embeddings if family(cfg.arch).rope else None
    )
    for field in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
        "tie_embeddings",
        "add_qkv_bias",
        "qk_layernorm",
        "kv_channels",
        "rotary_percent",
        "nope_layers",
        "rope_scaling",
        *(field for _, field in LLAMA3_ROPE_KEYS if cfg.rope_scaling == "llama3"),
        *(LONGROPE_FIELDS if cfg.rope_scaling == "longrope" else ()),
    ):
        if getattr(check, field) != getattr(cfg, field) and not (field == "tie_embeddings" and model_type == "reward"):
            raise CheckpointMismatchError(
                f"hf_config.json describes {field}={getattr(check, field)} but model.yaml has {getattr(cfg, field)}: "
                "point --model-config at the conversion directory this checkpoint came from"
            )
    if (check.num_query_groups or check.num_attention_heads) != (cfg.num_query_groups or cfg.num_attention_heads):
        raise CheckpointMismatchError("hf_config.json and model.yaml disagree on the number of KV heads")
    return out


def _config_from_model(cfg: ModelConfig) -> dict:
    import transformers

    spec = family(cfg.arch)
    variant = spec.hf.export_variant(cfg.add_qkv_bias, cfg.qk_layernorm, bool(cfg.nope_layers))
    values = dataclasses.asdict(cfg)
    values["num_query_groups"] = cfg.num_query_groups or cfg.num_attention_heads
    values["head_dim"] = cfg.kv_channels
    kwargs = {key: values[field] for field, key in spec.hf.config_keys}
    kwargs.update(spec.hf.export_extras)
    if spec.rope:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.rotary_base)}
        if cfg.rope_scaling == "llama3":
            kwargs["rope_parameters"].update({"rope_type": "llama3"})
            kwargs["rope_parameters"].update({key: values[field] for key, field in LLAMA3_ROPE_KEYS})
        if cfg.rope_scaling == "longrope":
            # the attention factor written out: HF would otherwise derive it from the (capped) max_position_embeddings
            original = cfg.rope_scaling_original_max_position_embeddings
            kwargs["rope_parameters"].update(
                rope_type="longrope",
                short_factor=list(cfg.rope_scaling_short_factor),
                long_factor=list(cfg.rope_scaling_long_factor),
                original_max_position_embeddings=original,
                attention_factor=cfg.rope_scaling_attention_factor,
            )
            kwargs["original_max_position_embeddings"] = original  # Phi3Config's own top-level key (default 4096)
        if cfg.rotary_percent != 1.0:  # (a variant whose HF model rotates part of the head: check_config)
            kwargs["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_percent
            kwargs["partial_rotary_factor"] = cfg.rotary_percent
    if variant.nope:  # one flag per layer, 0 = no RoPE (and no window: SmolLM3Config derives layer types from both)
        kwargs["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)]
        kwargs["use_sliding_window"] = False
    hf = getattr(transformers, variant.config_class)(**kwargs)
    hf.architectures = [variant.causal_lm]
    out = hf.to_dict()
    if spec.rope:
        # Older transformers read rope_theta at the top level; keeping both makes the file load in either.
        out.setdefault("rope_theta", float(cfg.rotary_base))
    return out


# -- weights --------------------------------------------------------------------------------------------------


def _layer(i: int, name: str) -> str:
    return f"decoder.layers.{i}.{name}"


class _Tensor(NamedTuple):
    """One full megatron tensor and the HF tensor(s) it is made of."""

    megatron: str
    hf: tuple[str, ...]  # one, or the pieces megatron fuses: q, k, v (grouped per KV group) or [gate; up]
    hf_shapes: tuple[tuple, ...]  # as HF stores them
    qkv: bool  # linear_qkv: regrouped per KV group, whether HF stores q, k, v apart or as one [q | k | v]
    transposed: bool  # a Conv1D weight, [in, out] in HF


@dataclass
class WeightMap:
    """HF <-> full megatron tensors for one model, as its family's HF names and layouts say; see the module
    docstring."""

    cfg: ModelConfig
    model_type: str  # policy | reward
    prefix: str  # HF name prefix of the backbone ("model.", "transformer." or "" for bare base-model files)

    @property
    def spec(self) -> FamilySpec:
        return family(self.cfg.arch)

    @property
    def ffn(self) -> int:
        return self.cfg.ffn_hidden_size or 4 * self.cfg.hidden_size

    @property
    def groups(self) -> int:
        return self.cfg.num_query_groups or self.cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.kv_channels

    def parts(self) -> list:
        return ["pre", *range(self.cfg.num_layers), "post"]

    def all_hf_shapes(self) -> dict[str, tuple]:
        out = {}
        for part in self.parts():
            out.update(self.hf_shapes(part))
        return out

    # -- the tensors of a part, as the family's HF names and layouts say ------------------------------------------
    def _tensors(self, part) -> list[_Tensor]:
        cfg, spec, hf = self.cfg, self.spec, self.spec.hf
        h, q, kv = cfg.hidden_size, cfg.num_attention_heads * self.head_dim, self.groups * self.head_dim
        if part == "pre":
            modules = [("embedding.word_embeddings", (hf.embedding,), (cfg.vocab_size, h), False)]
            if hf.position_embedding:
                positions = (cfg.max_position_embeddings, h)
                modules.append(("embedding.position_embeddings", (hf.position_embedding,), positions, False))
            within = self.prefix
        elif part == "post":
            modules = [("decoder.final_layernorm", (hf.final_norm,), (h,), spec.norm_bias)]
            within = self.prefix
        else:
            # megatron's shape of each layer module and whether it has a bias
            layout = {
                "input_layernorm": ((h,), spec.norm_bias),
                "self_attention.linear_qkv": ((q + 2 * kv, h), spec.qkv_bias(cfg)),
                "self_attention.linear_proj": ((h, q), spec.linear_bias),
                "pre_mlp_layernorm": ((h,), spec.norm_bias),
                "mlp.linear_fc1": ((self.ffn * (2 if spec.gated_mlp else 1), h), spec.linear_bias),
                "mlp.linear_fc2": ((h, self.ffn), spec.linear_bias),
            }
            named = list(hf.layer_modules)
            if cfg.qk_layernorm:
                if not hf.qk_norm_modules:
                    raise UnsupportedModelError(f"the {cfg.arch} family's HF format has no per-head q/k norms")
                for module, name in hf.qk_norm_modules:  # one [head_dim] norm shared by every head
                    layout[module] = ((self.head_dim,), spec.norm_bias)
                    named.append((module, (name,)))
            modules = [(_layer(part, m), names, *layout[m]) for m, names in named]
            within = self.prefix + hf.layer.format(i=part)
        out = []
        for module, names, shape, bias in modules:
            qkv = module.endswith("linear_qkv")
            # rows of each HF piece along megatron's dim 0: q, k, v when split, else equal parts ([gate; up])
            rows = [q, kv, kv] if qkv and len(names) == 3 else [shape[0] // len(names)] * len(names)
            for suffix, dims in [("weight", shape)] + ([("bias", shape[:1])] if bias else []):
                pieces = tuple((r, *dims[1:]) for r in rows)
                transposed = hf.conv1d and suffix == "weight" and ".linear_" in module
                if transposed:
                    pieces = tuple(p[::-1] for p in pieces)
                hf_names = tuple(f"{within}{name}.{suffix}" for name in names)
                out.append(_Tensor(f"{module}.{suffix}", hf_names, pieces, qkv, transposed))
        return out

    def hf_shapes(self, part) -> dict[str, tuple]:
        """The HF tensors `part` reads, with the shapes the config implies (for up-front validation)."""
        out = {name: shape for t in self._tensors(part) for name, shape in zip(t.hf, t.hf_shapes)}
        if part == "post":
            out.update(self._head_shapes())
        return out

    def to_megatron(self, part, read: Read) -> dict[str, torch.Tensor]:
        out = {}
        for t in self._tensors(part):
            pieces = [read(name) for name in t.hf]
            if t.transposed:
                pieces = [p.t().contiguous() for p in pieces]  # Conv1D [in, out] -> Linear [out, in]
            if t.qkv:
                out[t.megatron] = self._fuse_qkv(*(pieces if len(pieces) == 3 else self._unpack_qkv(pieces[0])))
            else:
                out[t.megatron] = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if part == "post":
            out.update(self._head_to_megatron(read))
        return out

    def to_hf(self, part, read: Read) -> dict[str, torch.Tensor]:
        out = {}
        for t in self._tensors(part):
            full = read(t.megatron)
            if t.qkv:
                q, k, v = self._split_qkv(full)
                pieces = [q, k, v] if len(t.hf) == 3 else [torch.cat([q, k, v], dim=0)]
            else:
                pieces = list(full.chunk(len(t.hf), dim=0)) if len(t.hf) > 1 else [full]
            if t.transposed:
                pieces = [p.t().contiguous() for p in pieces]
            out.update(zip(t.hf, pieces))
        if part == "post":
            out.update(self._head_to_hf(read))
        return out

    # -- fused q/k/v ---------------------------------------------------------------------------------------------
    def _unpack_qkv(self, qkv):
        """HF's one [q | k | v] tensor (each for all heads) -> q, k, v."""
        q = self.cfg.num_attention_heads * self.head_dim
        return qkv.split([q, self.groups * self.head_dim, self.groups * self.head_dim], dim=0)

    def _fuse_qkv(self, q, k, v):
        """[nq*hd, ...], [ng*hd, ...] x2 -> megatron's grouped [ng*(nq/ng + 2)*hd, ...]."""
        ng, hd = self.groups, self.head_dim
        rest = q.shape[1:]
        q_g = q.reshape(ng, (self.cfg.num_attention_heads // ng) * hd, *rest)
        return torch.cat([q_g, k.reshape(ng, hd, *rest), v.reshape(ng, hd, *rest)], dim=1).reshape(-1, *rest)

    def _split_qkv(self, qkv):
        ng, hd = self.groups, self.head_dim
        rest = qkv.shape[1:]
        per_q = (self.cfg.num_attention_heads // ng) * hd
        q, k, v = qkv.reshape(ng, per_q + 2 * hd, *rest).split([per_q, hd, hd], dim=1)
        return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)

    # -- heads: outside the backbone, the same rules in every family -------------------------------------------
    def _head_shapes(self) -> dict[str, tuple]:
        h, v, hf = self.cfg.hidden_size, self.cfg.vocab_size, self.spec.hf
        if self.model_type == "reward":
            return {f"{hf.score_head}.weight": (1, h)}
        return {} if self.cfg.tie_embeddings else {f"{hf.lm_head}.weight": (v, h)}

    def _head_to_megatron(self, read: Read) -> dict[str, torch.Tensor]:
        hf = self.spec.hf
        if self.model_type == "reward":
            w = read(f"{hf.score_head}.weight")
            # HF's score layer has no bias; the scalar head's bias starts at exactly 0, the same function.
            return {"output_layer.weight": w, "output_layer.bias": torch.zeros(1, dtype=w.dtype)}
        return {} if self.cfg.tie_embeddings else {"output_layer.weight": read(f"{hf.lm_head}.weight")}

    def _head_to_hf(self, read: Read) -> dict[str, torch.Tensor]:
        hf = self.spec.hf
        if self.model_type == "reward":
            return {f"{hf.score_head}.weight": read("output_layer.weight")}
        return {} if self.cfg.tie_embeddings else {f"{hf.lm_head}.weight": read("output_layer.weight")}


def weight_map(cfg: ModelConfig, model_type: str, prefix: str | None = None) -> WeightMap:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model type must be one of {MODEL_TYPES}, got {model_type!r}")
    return WeightMap(cfg, model_type, family(cfg.arch).hf.prefix if prefix is None else prefix)


def embedding_name(family_name: str, prefix: str) -> str:
    """The HF word-embedding tensor of a family's checkpoint with backbone prefix `prefix`."""
    return f"{prefix}{family(family_name).hf.embedding}.weight"


def detect_prefix(family_name: str, names: Iterable[str]) -> str:
    """The backbone prefix used by an HF checkpoint's tensor names ('model.' / 'transformer.' or none: files saved
    from the bare base model, as the original GPT-2 release was)."""
    names = set(names)
    default = family(family_name).hf.prefix
    for prefix in (default, ""):
        if embedding_name(family_name, prefix) in names:
            return prefix
    raise CheckpointMismatchError(
        f"no embedding tensor ({embedding_name(family_name, default)}) in the HF checkpoint: it is incomplete or not "
        f"a {family_name}-family model (first names: {sorted(names)[:5]})"
    )
