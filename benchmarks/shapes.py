"""The benchmarks' model shapes (megatron ModelConfig fields), in a module of their own so that a command line can
name them without importing torch or megatron-core; and a team's own model's shape from its Hugging Face config.json
(`model_from_hf_config`), with the job-config overrides that give a job that shape (`shape_overrides`)."""

import json
import os

PRESETS = {
    "1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # The 8B-class shape of issue 12 (Llama-3-8B-like, vocabulary 32000).
    "8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=100,
        max_position_embeddings=256,
    ),
}


def model_from_hf_config(path: str):
    """The ModelConfig of a Hugging Face causal LM's shape from its config.json (the file, or the directory holding
    it) in bf16: a benchmark timed on random weights of a team's own model without its weights. ValueError names
    what is wrong (no such file, not JSON, an architecture or setting aligner does not convert, a sequence
    classifier). Positions are capped at a sliding window shorter than the context (Mistral v0.1, Phi-3 mini 4k) and
    at LongRoPE's pre-training context (Phi-3.5), as the converter's --max-position-embeddings caps them, instead of
    refusing the model: the benchmarks' few hundred tokens lie within both, where the capped model is the same
    function."""
    from aligner.checkpoint.hf import model_config_from_hf, normalized_hf_config
    from aligner.families.spec import hf_rope, longrope_numbers

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            raw = json.load(f)
    except OSError as exc:
        raise ValueError(
            f"--hf-config {path}: {exc.strerror or exc} (give config.json or the directory holding it)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"--hf-config {file} is not JSON: {exc}") from None
    hf = normalized_hf_config(raw)
    window, positions = hf.get("sliding_window"), hf.get("max_position_embeddings")
    cap = window if window and positions and window < positions else None
    _, rope_type, params = hf_rope(hf)
    original, _ = longrope_numbers(hf, params) if rope_type == "longrope" else (None, 1.0)
    if original and positions and original < (cap or positions):
        cap = original
    cfg, _, model_type = model_config_from_hf(hf, params_dtype="bfloat16", max_position_embeddings=cap)
    if model_type != "policy":
        raise ValueError(f"--hf-config {file} describes a {model_type} model: the benchmarks time causal LMs")
    return cfg


def shape_overrides(cfg, section: str = "model") -> list[str]:
    """`SECTION.KEY=VALUE` overrides (OmegaConf's dotlist) that give a job config's model section the shape of
    ModelConfig `cfg`: every key a checkpoint's model.yaml decides (aligner.config.from_checkpoint.SHAPE_KEYS)."""
    from aligner.config.from_checkpoint import SHAPE_KEYS

    def text(value) -> str:
        return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value).strip("'")

    return [f"{section}.{key}={text(getattr(cfg, key))}" for key in SHAPE_KEYS]
