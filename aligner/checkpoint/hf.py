"""Hugging Face <-> megatron-core mappings: configs and weights, tensor by tensor (no model, no I/O here).

Supported HF architectures (`SUPPORTED`): the Llama family (Llama 2/3, Mistral, Qwen2 with its q/k/v biases) and
GPT-2, each as a causal LM (`policy`) or as `*ForSequenceClassification` with one label (`reward`, the `score` head).

Contract:
- `model_config_from_hf(hf_cfg)` -> (ModelConfig, family, model_type) checks every field megatron cannot express
  (rope scaling, sliding windows, biases, head_dim, activations) and raises `UnsupportedModelError` naming it;
  `hf_config_for_export(model_cfg, model_type, source)` is the reverse (exact when the source config is kept).
- `weight_map(family, cfg, model_type)` returns a `WeightMap` whose `parts()` are "pre" (embeddings), the layer
  indices 0..L-1 and "post" (final norm, output layer / score head). `to_megatron(part, read)` maps one part's HF
  tensors (fetched lazily through `read(hf_name)`) to *full* megatron tensors: TP=1 names (local layer spec, global
  layer numbers) with the unpadded vocabulary, the canonical form of aligner.models.sharding. `to_hf(part, read)`
  is the exact inverse (`read(megatron_name)`). Both only permute, transpose, split and concatenate, so a round
  trip is bit-identical. Callers stream part by part, so at most one layer is held twice.
- megatron's fused QKV (per KV group g: the q heads of g, then k_g, then v_g) and gated fc1 ([gate; up]) are the
  only non-trivial layouts; GPT-2's Conv1D weights are stored [in, out] and are transposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from aligner.config.schema import ModelConfig

Read = Callable[[str], torch.Tensor]

# HF architecture -> (family, model type)
SUPPORTED = {
    "LlamaForCausalLM": ("llama", "policy"),
    "MistralForCausalLM": ("llama", "policy"),
    "Qwen2ForCausalLM": ("llama", "policy"),
    "GPT2LMHeadModel": ("gpt2", "policy"),
    "LlamaForSequenceClassification": ("llama", "reward"),
    "MistralForSequenceClassification": ("llama", "reward"),
    "Qwen2ForSequenceClassification": ("llama", "reward"),
    "GPT2ForSequenceClassification": ("gpt2", "reward"),
}
MODEL_TYPES = ("policy", "reward")
_LLAMA_TYPES = ("llama", "mistral", "qwen2")
_GPT2_ACTS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh approximation megatron's GPT-2 uses


class UnsupportedModelError(ValueError):
    """The HF checkpoint uses an architecture or a feature the megatron model cannot express."""


class CheckpointMismatchError(ValueError):
    """A tensor is missing or has a shape its config does not imply."""


def _get(cfg, name, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


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
    except (ValueError, KeyError) as exc:
        raise UnsupportedModelError(
            f"config.json 'model_type' = {raw.get('model_type')!r} is not understood by transformers: {exc}"
        ) from exc


def _rope(hf_cfg) -> tuple[float, str, dict]:
    """(rope_theta, rope_type, parameters) from `rope_parameters` (transformers 5) or rope_theta/rope_scaling."""
    params = _get(hf_cfg, "rope_parameters") or _get(hf_cfg, "rope_scaling") or {}
    theta = params.get("rope_theta", _get(hf_cfg, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    return float(theta), rope_type, params


def _check_llama(hf_cfg, model_type_hf: str) -> None:
    def unsupported(field, value, what):
        raise UnsupportedModelError(f"config.json '{field}' = {value!r}: {what}")

    act = _get(hf_cfg, "hidden_act", "silu")
    if act != "silu":
        unsupported("hidden_act", act, "the Llama family is supported with SwiGLU (silu) only")
    hidden, heads = _get(hf_cfg, "hidden_size"), _get(hf_cfg, "num_attention_heads")
    head_dim = _get(hf_cfg, "head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        unsupported(
            "head_dim", head_dim, f"only head_dim = hidden_size / num_attention_heads = {hidden // heads} is supported"
        )
    if model_type_hf in ("llama", "mistral") and _get(hf_cfg, "attention_bias", False):
        unsupported(
            "attention_bias", True, "biases on q/k/v/o projections are not supported (Qwen2's q/k/v-only biases are)"
        )
    if _get(hf_cfg, "mlp_bias", False):
        unsupported("mlp_bias", True, "MLP biases are not supported in the Llama family")
    _, rope_type, _ = _rope(hf_cfg)
    if rope_type != "default":
        unsupported("rope_parameters.rope_type", rope_type, "only unscaled RoPE ('default') is supported")
    max_pos = _get(hf_cfg, "max_position_embeddings")
    window = _get(hf_cfg, "sliding_window")
    uses_window = _get(hf_cfg, "use_sliding_window", model_type_hf == "mistral")
    if uses_window and window is not None and window < max_pos:
        unsupported(
            "sliding_window",
            window,
            f"sliding-window attention shorter than max_position_embeddings={max_pos} is not supported; "
            f"pass --max-position-embeddings {window} to convert for sequences within the window "
            "(where full causal attention is exact)",
        )


def _check_gpt2(hf_cfg) -> None:
    act = _get(hf_cfg, "activation_function", "gelu_new")
    if act not in _GPT2_ACTS:
        raise UnsupportedModelError(
            f"config.json 'activation_function' = {act!r}: GPT-2 is supported with the tanh "
            f"GELU ({', '.join(_GPT2_ACTS)})"
        )
    for field, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if bool(_get(hf_cfg, field, ok)) != ok:
            raise UnsupportedModelError(f"config.json '{field}' = {_get(hf_cfg, field)!r}: only {ok} is supported")


def model_config_from_hf(
    hf_cfg, params_dtype: str = "float32", max_position_embeddings: int | None = None
) -> tuple[ModelConfig, str, str]:
    """ModelConfig for an HF config (a transformers config object or the config.json dict).

    Returns (model_cfg, family, model_type). `max_position_embeddings` may only lower the HF value (the cap that
    makes a long sliding window exact); learned GPT-2 positions cannot change.
    """
    arch = architecture_of(hf_cfg)
    family, model_type = SUPPORTED[arch]
    if model_type == "reward":
        labels = _get(hf_cfg, "num_labels", len(_get(hf_cfg, "id2label", None) or {0: 0}))
        if labels != 1:
            raise UnsupportedModelError(
                f"{arch} with num_labels={labels}: a reward model has exactly one label (one score per sequence)"
            )
    if family == "gpt2":
        _check_gpt2(hf_cfg)
        hidden = _get(hf_cfg, "n_embd")
        if max_position_embeddings not in (None, _get(hf_cfg, "n_positions")):
            raise UnsupportedModelError(
                "--max-position-embeddings cannot change GPT-2's learned positions "
                f"(n_positions={_get(hf_cfg, 'n_positions')})"
            )
        cfg = ModelConfig(
            arch="gpt2",
            num_layers=_get(hf_cfg, "n_layer"),
            hidden_size=hidden,
            num_attention_heads=_get(hf_cfg, "n_head"),
            num_query_groups=None,
            ffn_hidden_size=_get(hf_cfg, "n_inner") or 4 * hidden,
            vocab_size=_get(hf_cfg, "vocab_size"),
            max_position_embeddings=_get(hf_cfg, "n_positions"),
            norm_epsilon=_get(hf_cfg, "layer_norm_epsilon"),
            tie_embeddings=bool(_get(hf_cfg, "tie_word_embeddings", True)),
            add_qkv_bias=False,
            init_method_std=_get(hf_cfg, "initializer_range", 0.02),
            params_dtype=params_dtype,
        )
        return cfg, family, model_type
    model_type_hf = _get(hf_cfg, "model_type")
    if model_type_hf not in _LLAMA_TYPES:
        raise UnsupportedModelError(
            f"config.json 'model_type' = {model_type_hf!r} with architecture {arch}: expected one of {_LLAMA_TYPES}"
        )
    if max_position_embeddings is None:
        _check_llama(hf_cfg, model_type_hf)
    else:
        if max_position_embeddings > _get(hf_cfg, "max_position_embeddings"):
            raise UnsupportedModelError(
                f"--max-position-embeddings {max_position_embeddings} exceeds the model's "
                f"max_position_embeddings={_get(hf_cfg, 'max_position_embeddings')}"
            )
        capped = dict(hf_cfg if isinstance(hf_cfg, dict) else hf_cfg.to_dict())
        capped["max_position_embeddings"] = max_position_embeddings
        _check_llama(capped, model_type_hf)
    heads = _get(hf_cfg, "num_attention_heads")
    theta, _, _ = _rope(hf_cfg)
    cfg = ModelConfig(
        arch="llama",
        num_layers=_get(hf_cfg, "num_hidden_layers"),
        hidden_size=_get(hf_cfg, "hidden_size"),
        num_attention_heads=heads,
        num_query_groups=_get(hf_cfg, "num_key_value_heads") or heads,
        ffn_hidden_size=_get(hf_cfg, "intermediate_size"),
        vocab_size=_get(hf_cfg, "vocab_size"),
        max_position_embeddings=max_position_embeddings or _get(hf_cfg, "max_position_embeddings"),
        rotary_base=theta,
        norm_epsilon=_get(hf_cfg, "rms_norm_eps"),
        tie_embeddings=bool(_get(hf_cfg, "tie_word_embeddings", False)),
        add_qkv_bias=model_type_hf == "qwen2",
        init_method_std=_get(hf_cfg, "initializer_range", 0.02),
        params_dtype=params_dtype,
    )
    return cfg, family, model_type


def family_of(cfg: ModelConfig) -> str:
    return "gpt2" if cfg.arch == "gpt2" else "llama"


def hf_architecture(cfg: ModelConfig, model_type: str, source: dict | None = None) -> str:
    """The HF class to export to: the source's family (Llama/Mistral/Qwen2/GPT-2) with the head of `model_type`."""
    if source and _get(source, "architectures"):
        base = architecture_of(source)
        for suffix in ("ForCausalLM", "LMHeadModel", "ForSequenceClassification"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
                break
    else:
        base = "GPT2" if cfg.arch == "gpt2" else ("Qwen2" if cfg.add_qkv_bias else "Llama")
    if base == "GPT2":
        return "GPT2LMHeadModel" if model_type == "policy" else "GPT2ForSequenceClassification"
    return base + ("ForCausalLM" if model_type == "policy" else "ForSequenceClassification")


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
        normalized_hf_config(out), cfg.params_dtype, cfg.max_position_embeddings if cfg.arch == "llama" else None
    )
    for field in (
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "ffn_hidden_size",
        "vocab_size",
        "tie_embeddings",
        "add_qkv_bias",
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
    if cfg.arch == "gpt2":
        from transformers import GPT2Config

        hf = GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_position_embeddings,
            n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers,
            n_head=cfg.num_attention_heads,
            n_inner=cfg.ffn_hidden_size,
            layer_norm_epsilon=cfg.norm_epsilon,
            activation_function="gelu_new",
            tie_word_embeddings=cfg.tie_embeddings,
            initializer_range=cfg.init_method_std,
        )
        hf.architectures = ["GPT2LMHeadModel"]
        return hf.to_dict()
    from transformers import LlamaConfig, Qwen2Config

    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_query_groups or cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_method_std,
        rope_parameters={"rope_type": "default", "rope_theta": float(cfg.rotary_base)},
    )
    hf = Qwen2Config(**kwargs) if cfg.add_qkv_bias else LlamaConfig(**kwargs)
    hf.architectures = ["Qwen2ForCausalLM" if cfg.add_qkv_bias else "LlamaForCausalLM"]
    out = hf.to_dict()
    # Older transformers read rope_theta at the top level; keeping both makes the file load in either.
    out.setdefault("rope_theta", float(cfg.rotary_base))
    return out


# -- weights --------------------------------------------------------------------------------------------------


@dataclass
class WeightMap:
    """HF <-> full megatron tensors for one model; see the module docstring. Subclasses: `_Llama`, `_GPT2`."""

    cfg: ModelConfig
    model_type: str  # policy | reward
    prefix: str  # HF name prefix of the backbone ("model.", "transformer." or "" for bare base-model files)

    @property
    def ffn(self) -> int:
        return self.cfg.ffn_hidden_size or 4 * self.cfg.hidden_size

    @property
    def groups(self) -> int:
        return self.cfg.num_query_groups or self.cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.cfg.hidden_size // self.cfg.num_attention_heads

    def parts(self) -> list:
        return ["pre", *range(self.cfg.num_layers), "post"]

    def hf_shapes(self, part) -> dict[str, tuple]:
        """The HF tensors `part` reads, with the shapes the config implies (for up-front validation)."""
        raise NotImplementedError

    def to_megatron(self, part, read: Read) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def to_hf(self, part, read: Read) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def all_hf_shapes(self) -> dict[str, tuple]:
        out = {}
        for part in self.parts():
            out.update(self.hf_shapes(part))
        return out

    # Heads shared by both families.
    def _head_shapes(self, head_name: str) -> dict[str, tuple]:
        h, v = self.cfg.hidden_size, self.cfg.vocab_size
        if self.model_type == "reward":
            return {"score.weight": (1, h)}
        return {} if self.cfg.tie_embeddings else {head_name: (v, h)}

    def _head_to_megatron(self, head_name: str, read: Read) -> dict[str, torch.Tensor]:
        if self.model_type == "reward":
            w = read("score.weight")
            # HF's score layer has no bias; the scalar head's bias starts at exactly 0, the same function.
            return {"output_layer.weight": w, "output_layer.bias": torch.zeros(1, dtype=w.dtype)}
        return {} if self.cfg.tie_embeddings else {"output_layer.weight": read(head_name)}

    def _head_to_hf(self, head_name: str, read: Read) -> dict[str, torch.Tensor]:
        if self.model_type == "reward":
            return {"score.weight": read("output_layer.weight")}
        return {} if self.cfg.tie_embeddings else {head_name: read("output_layer.weight")}


def _layer(i: int, name: str) -> str:
    return f"decoder.layers.{i}.{name}"


class _Llama(WeightMap):
    def _hf(self, i, name):
        return f"{self.prefix}layers.{i}.{name}"

    def hf_shapes(self, part):
        h, hd, nq, ng = self.cfg.hidden_size, self.head_dim, self.cfg.num_attention_heads, self.groups
        if part == "pre":
            return {f"{self.prefix}embed_tokens.weight": (self.cfg.vocab_size, h)}
        if part == "post":
            return {f"{self.prefix}norm.weight": (h,), **self._head_shapes("lm_head.weight")}
        shapes = {
            self._hf(part, "input_layernorm.weight"): (h,),
            self._hf(part, "self_attn.q_proj.weight"): (nq * hd, h),
            self._hf(part, "self_attn.k_proj.weight"): (ng * hd, h),
            self._hf(part, "self_attn.v_proj.weight"): (ng * hd, h),
            self._hf(part, "self_attn.o_proj.weight"): (h, nq * hd),
            self._hf(part, "post_attention_layernorm.weight"): (h,),
            self._hf(part, "mlp.gate_proj.weight"): (self.ffn, h),
            self._hf(part, "mlp.up_proj.weight"): (self.ffn, h),
            self._hf(part, "mlp.down_proj.weight"): (h, self.ffn),
        }
        if self.cfg.add_qkv_bias:
            shapes.update(
                {
                    self._hf(part, "self_attn.q_proj.bias"): (nq * hd,),
                    self._hf(part, "self_attn.k_proj.bias"): (ng * hd,),
                    self._hf(part, "self_attn.v_proj.bias"): (ng * hd,),
                }
            )
        return shapes

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

    def to_megatron(self, part, read):
        if part == "pre":
            return {"embedding.word_embeddings.weight": read(f"{self.prefix}embed_tokens.weight")}
        if part == "post":
            return {
                "decoder.final_layernorm.weight": read(f"{self.prefix}norm.weight"),
                **self._head_to_megatron("lm_head.weight", read),
            }
        i = part
        attn = "self_attn."
        out = {
            _layer(i, "input_layernorm.weight"): read(self._hf(i, "input_layernorm.weight")),
            _layer(i, "self_attention.linear_qkv.weight"): self._fuse_qkv(
                *(read(self._hf(i, f"{attn}{p}_proj.weight")) for p in "qkv")
            ),
            _layer(i, "self_attention.linear_proj.weight"): read(self._hf(i, "self_attn.o_proj.weight")),
            _layer(i, "pre_mlp_layernorm.weight"): read(self._hf(i, "post_attention_layernorm.weight")),
            _layer(i, "mlp.linear_fc1.weight"): torch.cat(
                [read(self._hf(i, "mlp.gate_proj.weight")), read(self._hf(i, "mlp.up_proj.weight"))], dim=0
            ),
            _layer(i, "mlp.linear_fc2.weight"): read(self._hf(i, "mlp.down_proj.weight")),
        }
        if self.cfg.add_qkv_bias:
            out[_layer(i, "self_attention.linear_qkv.bias")] = self._fuse_qkv(
                *(read(self._hf(i, f"{attn}{p}_proj.bias")) for p in "qkv")
            )
        return out

    def to_hf(self, part, read):
        if part == "pre":
            return {f"{self.prefix}embed_tokens.weight": read("embedding.word_embeddings.weight")}
        if part == "post":
            return {
                f"{self.prefix}norm.weight": read("decoder.final_layernorm.weight"),
                **self._head_to_hf("lm_head.weight", read),
            }
        i = part
        q, k, v = self._split_qkv(read(_layer(i, "self_attention.linear_qkv.weight")))
        gate, up = read(_layer(i, "mlp.linear_fc1.weight")).chunk(2, dim=0)
        out = {
            self._hf(i, "input_layernorm.weight"): read(_layer(i, "input_layernorm.weight")),
            self._hf(i, "self_attn.q_proj.weight"): q,
            self._hf(i, "self_attn.k_proj.weight"): k,
            self._hf(i, "self_attn.v_proj.weight"): v,
            self._hf(i, "self_attn.o_proj.weight"): read(_layer(i, "self_attention.linear_proj.weight")),
            self._hf(i, "post_attention_layernorm.weight"): read(_layer(i, "pre_mlp_layernorm.weight")),
            self._hf(i, "mlp.gate_proj.weight"): gate,
            self._hf(i, "mlp.up_proj.weight"): up,
            self._hf(i, "mlp.down_proj.weight"): read(_layer(i, "mlp.linear_fc2.weight")),
        }
        if self.cfg.add_qkv_bias:
            qb, kb, vb = self._split_qkv(read(_layer(i, "self_attention.linear_qkv.bias")))
            out.update(
                {
                    self._hf(i, "self_attn.q_proj.bias"): qb,
                    self._hf(i, "self_attn.k_proj.bias"): kb,
                    self._hf(i, "self_attn.v_proj.bias"): vb,
                }
            )
        return out


class _GPT2(WeightMap):
    """GPT-2: Conv1D weights are [in, out] (transposed vs nn.Linear); c_attn's columns are [q | k | v], each all
    heads, while megatron (one KV group per head) wants per head [q_h; k_h; v_h]."""

    def _hf(self, i, name):
        return f"{self.prefix}h.{i}.{name}"

    def hf_shapes(self, part):
        h, f = self.cfg.hidden_size, self.ffn
        if part == "pre":
            return {
                f"{self.prefix}wte.weight": (self.cfg.vocab_size, h),
                f"{self.prefix}wpe.weight": (self.cfg.max_position_embeddings, h),
            }
        if part == "post":
            return {
                f"{self.prefix}ln_f.weight": (h,),
                f"{self.prefix}ln_f.bias": (h,),
                **self._head_shapes("lm_head.weight"),
            }
        return {
            self._hf(part, "ln_1.weight"): (h,),
            self._hf(part, "ln_1.bias"): (h,),
            self._hf(part, "attn.c_attn.weight"): (h, 3 * h),
            self._hf(part, "attn.c_attn.bias"): (3 * h,),
            self._hf(part, "attn.c_proj.weight"): (h, h),
            self._hf(part, "attn.c_proj.bias"): (h,),
            self._hf(part, "ln_2.weight"): (h,),
            self._hf(part, "ln_2.bias"): (h,),
            self._hf(part, "mlp.c_fc.weight"): (h, f),
            self._hf(part, "mlp.c_fc.bias"): (f,),
            self._hf(part, "mlp.c_proj.weight"): (f, h),
            self._hf(part, "mlp.c_proj.bias"): (h,),
        }

    def _qkv_to_megatron(self, qkv_3H):
        """[3*h, ...] as [q | k | v] -> per head [q_h; k_h; v_h] (megatron with one query group per head)."""
        nh, hd = self.cfg.num_attention_heads, self.head_dim
        rest = qkv_3H.shape[1:]
        return qkv_3H.reshape(3, nh, hd, *rest).transpose(0, 1).reshape(-1, *rest)

    def _qkv_to_hf(self, qkv):
        nh, hd = self.cfg.num_attention_heads, self.head_dim
        rest = qkv.shape[1:]
        return qkv.reshape(nh, 3, hd, *rest).transpose(0, 1).reshape(-1, *rest)

    def to_megatron(self, part, read):
        p = self.prefix
        if part == "pre":
            return {
                "embedding.word_embeddings.weight": read(f"{p}wte.weight"),
                "embedding.position_embeddings.weight": read(f"{p}wpe.weight"),
            }
        if part == "post":
            return {
                "decoder.final_layernorm.weight": read(f"{p}ln_f.weight"),
                "decoder.final_layernorm.bias": read(f"{p}ln_f.bias"),
                **self._head_to_megatron("lm_head.weight", read),
            }
        i = part

        def t(name):  # Conv1D [in, out] -> Linear [out, in]
            return read(self._hf(i, name)).t().contiguous()

        return {
            _layer(i, "input_layernorm.weight"): read(self._hf(i, "ln_1.weight")),
            _layer(i, "input_layernorm.bias"): read(self._hf(i, "ln_1.bias")),
            _layer(i, "self_attention.linear_qkv.weight"): self._qkv_to_megatron(t("attn.c_attn.weight")),
            _layer(i, "self_attention.linear_qkv.bias"): self._qkv_to_megatron(read(self._hf(i, "attn.c_attn.bias"))),
            _layer(i, "self_attention.linear_proj.weight"): t("attn.c_proj.weight"),
            _layer(i, "self_attention.linear_proj.bias"): read(self._hf(i, "attn.c_proj.bias")),
            _layer(i, "pre_mlp_layernorm.weight"): read(self._hf(i, "ln_2.weight")),
            _layer(i, "pre_mlp_layernorm.bias"): read(self._hf(i, "ln_2.bias")),
            _layer(i, "mlp.linear_fc1.weight"): t("mlp.c_fc.weight"),
            _layer(i, "mlp.linear_fc1.bias"): read(self._hf(i, "mlp.c_fc.bias")),
            _layer(i, "mlp.linear_fc2.weight"): t("mlp.c_proj.weight"),
            _layer(i, "mlp.linear_fc2.bias"): read(self._hf(i, "mlp.c_proj.bias")),
        }

    def to_hf(self, part, read):
        p = self.prefix
        if part == "pre":
            return {
                f"{p}wte.weight": read("embedding.word_embeddings.weight"),
                f"{p}wpe.weight": read("embedding.position_embeddings.weight"),
            }
        if part == "post":
            return {
                f"{p}ln_f.weight": read("decoder.final_layernorm.weight"),
                f"{p}ln_f.bias": read("decoder.final_layernorm.bias"),
                **self._head_to_hf("lm_head.weight", read),
            }
        i = part

        def t(name):
            return read(_layer(i, name)).t().contiguous()

        return {
            self._hf(i, "ln_1.weight"): read(_layer(i, "input_layernorm.weight")),
            self._hf(i, "ln_1.bias"): read(_layer(i, "input_layernorm.bias")),
            self._hf(i, "attn.c_attn.weight"): self._qkv_to_hf(read(_layer(i, "self_attention.linear_qkv.weight")))
            .t()
            .contiguous(),
            self._hf(i, "attn.c_attn.bias"): self._qkv_to_hf(read(_layer(i, "self_attention.linear_qkv.bias"))),
            self._hf(i, "attn.c_proj.weight"): t("self_attention.linear_proj.weight"),
            self._hf(i, "attn.c_proj.bias"): read(_layer(i, "self_attention.linear_proj.bias")),
            self._hf(i, "ln_2.weight"): read(_layer(i, "pre_mlp_layernorm.weight")),
            self._hf(i, "ln_2.bias"): read(_layer(i, "pre_mlp_layernorm.bias")),
            self._hf(i, "mlp.c_fc.weight"): t("mlp.linear_fc1.weight"),
            self._hf(i, "mlp.c_fc.bias"): read(_layer(i, "mlp.linear_fc1.bias")),
            self._hf(i, "mlp.c_proj.weight"): t("mlp.linear_fc2.weight"),
            self._hf(i, "mlp.c_proj.bias"): read(_layer(i, "mlp.linear_fc2.bias")),
        }


DEFAULT_PREFIX = {"llama": "model.", "gpt2": "transformer."}


def weight_map(cfg: ModelConfig, model_type: str, prefix: str | None = None) -> WeightMap:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model type must be one of {MODEL_TYPES}, got {model_type!r}")
    family = family_of(cfg)
    cls = _GPT2 if family == "gpt2" else _Llama
    return cls(cfg, model_type, DEFAULT_PREFIX[family] if prefix is None else prefix)


def detect_prefix(family: str, names: Iterable[str]) -> str:
    """The backbone prefix used by an HF checkpoint's tensor names ('model.' / 'transformer.' or none: files saved
    from the bare base model, as the original GPT-2 release was)."""
    names = set(names)
    probe = "embed_tokens.weight" if family == "llama" else "wte.weight"
    for prefix in (DEFAULT_PREFIX[family], ""):
        if prefix + probe in names:
            return prefix
    raise CheckpointMismatchError(
        f"no embedding tensor ({DEFAULT_PREFIX[family]}{probe}) in the HF checkpoint: it is incomplete or not a "
        f"{family}-family model (first names: {sorted(names)[:5]})"
    )
