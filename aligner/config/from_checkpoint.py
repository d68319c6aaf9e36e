"""A model section takes its shape from its checkpoint: `<checkpoint>/model.yaml`, under what the user wrote.

A converted directory and every job checkpoint carry `model.yaml` (the ModelConfig they were built with). When a
job config's model section (`model`, the critic's `reward_model`) sets `checkpoint`, `fill_from_checkpoint` reads that
file (YAML only: config loading imports no torch) and layers it between the defaults and the user's own keys:

    schema defaults < `defaults:` of the config file (base files, presets such as `model: llama_1b`)
                    < the checkpoint's model.yaml
                    < the config file's own keys and the command line ("explicit")

So `model.checkpoint=DIR` alone is enough; a shape key the user wrote explicitly must agree with the checkpoint (an
error names both values); `max_position_embeddings` may be lowered (shorter sequences), never raised past the
checkpoint's, and for learned positions must agree. Run-time choices (attention backend, dropout) are never taken
from the checkpoint. The tokenizer, unless set, is the checkpoint's own: its `tokenizer/` directory (conversion
copies the HF tokenizer there), else the one its model.yaml names if that still exists. A checkpoint without
model.yaml (a step saved without one) leaves the section as written: then strict loading checks it.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from aligner.config.errors import ConfigError
from aligner.config.paths import resolve_file
from aligner.config.schema import ModelConfig
from aligner.families import family

# Keys whose values must agree with the checkpoint when the user sets them: they decide which tensors exist and
# their shapes, or the function the weights compute.
SHAPE_KEYS = (
    "arch",
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "head_dim",
    "vocab_size",
    "rotary_base",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings",
    "rope_scaling_short_factor",
    "rope_scaling_long_factor",
    "rope_scaling_attention_factor",
    "rotary_percent",
    "norm_epsilon",
    "tie_embeddings",
    "add_qkv_bias",
    "qk_layernorm",
    "nope_layers",
)
# Never taken from the checkpoint: where it is (the user's path wins), the tokenizer (below), run-time choices.
NOT_INHERITED = (
    "checkpoint",
    "tokenizer",
    "attention_backend",
    "hidden_dropout",
    "attention_dropout",
    "recompute",
    "sequence_parallel",
    "recompute_method",
    "recompute_num_layers",
    "rope_fusion",
    "logprob_fusion",
)


def _effective(cfg: ModelConfig, key: str):
    """The value a key stands for (None = its default meaning), so that `null` and the number it means agree."""
    if key == "num_query_groups":
        return cfg.num_query_groups or cfg.num_attention_heads
    if key == "ffn_hidden_size":
        return cfg.ffn_hidden_size or 4 * cfg.hidden_size
    if key == "head_dim":
        return cfg.kv_channels
    if key.startswith("rope_scaling_") and cfg.rope_scaling is None:
        return None  # the numbers of an unused scaling mean nothing
    return getattr(cfg, key)


def read_checkpoint_model(checkpoint: str) -> tuple[str, ModelConfig] | None:
    """(path, ModelConfig) of `<checkpoint>/model.yaml`, or None when there is none."""
    path = os.path.join(checkpoint, "model.yaml")
    if not os.path.isfile(path):
        return None
    try:
        node = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(path))
        return path, OmegaConf.to_object(node)
    except (OmegaConfBaseException, OSError, ValueError) as exc:
        raise ConfigError(path, f"cannot read the checkpoint's model description: {str(exc).splitlines()[0]}") from exc


def checkpoint_tokenizer(checkpoint: str, stored: ModelConfig) -> str | None:
    own = os.path.join(checkpoint, "tokenizer")
    if os.path.isdir(own):
        return own
    if stored.tokenizer and os.path.isabs(stored.tokenizer) and os.path.exists(stored.tokenizer):
        return stored.tokenizer
    return None


def fill_from_checkpoint(
    merged: DictConfig, explicit: DictConfig, sections: tuple[str, ...], config_dir: str | None
) -> DictConfig:
    """`merged` (the whole typed config) with each section in `sections` that names a checkpoint filled from its
    model.yaml, except the keys `explicit` (the file's own keys and the command line) sets; see the module
    docstring. Raises ConfigError naming the key, the user's value and the checkpoint's."""
    for section in sections:
        node = merged.get(section)
        if node is None or node.get("checkpoint") is None:
            continue
        key = f"{section}.checkpoint"
        checkpoint = resolve_file(str(node.checkpoint), key, config_dir)
        found = read_checkpoint_model(checkpoint)
        if found is None:
            continue
        yaml_path, stored = found
        mine_node = explicit.get(section) if isinstance(explicit, DictConfig) else None
        written = set(mine_node.keys()) if isinstance(mine_node, DictConfig) else set()
        user = OmegaConf.to_object(node)
        for name in SHAPE_KEYS:
            if name in written and _effective(user, name) != _effective(stored, name):
                raise ConfigError(
                    f"{section}.{name}",
                    f"{getattr(user, name)!r} disagrees with the checkpoint's {getattr(stored, name)!r} ({yaml_path}): "
                    f"leave {section}.{name} out to take the checkpoint's value, or point {key} at a matching one",
                )
        if "max_position_embeddings" in written:
            mine, theirs = user.max_position_embeddings, stored.max_position_embeddings
            learned = not family(stored.arch).rope  # learned positions: a [max_positions, hidden] tensor
            if mine > theirs or (learned and mine != theirs):
                raise ConfigError(
                    f"{section}.max_position_embeddings",
                    f"{mine} disagrees with the checkpoint's {theirs} ({yaml_path}): "
                    + ("learned positions cannot change" if learned else "it may be lowered, never raised"),
                )
        fill = {
            name: value
            for name, value in OmegaConf.to_container(OmegaConf.structured(stored)).items()
            if name not in written and name not in NOT_INHERITED
        }
        fill["checkpoint"] = checkpoint
        if "tokenizer" not in written:
            tokenizer = checkpoint_tokenizer(checkpoint, stored)
            if tokenizer is not None:
                fill["tokenizer"] = tokenizer
        merged = OmegaConf.merge(merged, {section: fill})
    return merged
