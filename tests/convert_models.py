"""Tiny Hugging Face reference models for the conversion tests: built from configs (nothing downloaded), float32,
eager attention, every weight (norms and biases included) set to seeded random values so a misplaced tensor
always changes the output, saved with a tiny word-level tokenizer of fewer ids than embedding rows.
"""

from __future__ import annotations

import json
import math
import os

import torch

VOCAB = 100  # embedding rows; megatron pads them to 128 (TP=1) or 256 (TP=2)
N_TOKENS = 90  # tokenizer ids: fewer than the embedding rows, as in many HF models
TOKENS_BT = torch.randint(1, N_TOKENS, (2, 12), generator=torch.Generator().manual_seed(3))
KINDS = (
    "llama", "mistral", "qwen2", "gpt2", "llama_reward", "llama3", "llama3_reward", "qwen3", "qwen3_reward", "phi3",
    "phi3_reward", "phi3_longrope", "phi4mini", "smollm3",
)  # fmt: skip
# Llama 3.1's RoPE scaling with other numbers than megatron's hard-coded ones (1, 4, 8192), chosen so the tiny model's
# 8 frequencies (head width 16, theta 10000: wavelengths 6.3 ... 2e4) fall in all three bands: kept (< 48/6 = 8),
# smoothed (8 .. 32) and divided by the factor (> 48/1.5 = 32).
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 5.0,
    "low_freq_factor": 1.5,
    "high_freq_factor": 6.0,
    "original_max_position_embeddings": 48,
}
# Phi-3.5-style LongRoPE: 256 positions of which 64 pre-trained, so HF derives the attention factor sqrt(1 + ln 4 /
# ln 64) = 1.1547 (cos and sin times that); one short and one long factor per frequency (head width 16: 8), unlike
# each other and far from 1, so that frequencies taken from the wrong list, or none, change every position's angle.
LONGROPE_ATTENTION = (1 + math.log(4) / math.log(64)) ** 0.5
# converter caps (--max-position-embeddings) a kind needs: LongRoPE is converted within its pre-training context
CONVERT_CAP = {"phi3_longrope": 64, "phi4mini": 64}


def longrope_parameters(pairs: int, original: int, partial: float = 1.0) -> dict:
    """HF rope_parameters of a LongRoPE with `pairs` frequencies (rotated width / 2: head width x `partial` / 2):
    short factors rising from 1 to 11, long ones 4x those."""
    short = [round(1 + 10 * (i / (pairs - 1)) ** 2, 4) for i in range(pairs)]
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": short,
        "long_factor": [4 * f for f in short],
        "original_max_position_embeddings": original,
        "partial_rotary_factor": partial,  # (what transformers adds at a config's creation; an assignment lacks it)
    }


QWEN3_HEAD_DIM = 24  # not hidden_size / heads = 16: q is [96, 64], o_proj [64, 96]


def tiny_tokenizer(n_tokens: int = N_TOKENS):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(n_tokens)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def hf_config(kind: str):
    import transformers as tf

    llama = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        pad_token_id=0,
    )
    if kind == "llama":
        return tf.LlamaConfig(**llama, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if kind == "llama_reward":
        return tf.LlamaConfig(**llama, num_labels=1)
    if kind == "mistral":
        return tf.MistralConfig(
            **llama, sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
        )
    if kind == "qwen2":
        return tf.Qwen2Config(**llama, tie_word_embeddings=True)
    if kind in ("llama3", "llama3_reward"):  # Llama 3.2 1B/3B: llama3 RoPE scaling and tied embeddings
        labels = {"num_labels": 1} if kind.endswith("reward") else {}
        return tf.LlamaConfig(**llama, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=True, **labels)
    if kind in ("qwen3", "qwen3_reward"):
        labels = {"num_labels": 1} if kind.endswith("reward") else {}
        return tf.Qwen3Config(
            **llama,
            head_dim=QWEN3_HEAD_DIM,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            **labels,
        )
    if kind in ("phi3", "phi3_reward"):  # q/k/v as one qkv_proj, gate and up as one gate_up_proj
        labels = {"num_labels": 1} if kind.endswith("reward") else {}
        return tf.Phi3Config(**llama, rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, **labels)
    if kind == "phi3_longrope":  # Phi-3.5 mini / Phi-3 128k: LongRoPE over a longer context than pre-trained
        return tf.Phi3Config(
            **dict(llama, max_position_embeddings=256),
            original_max_position_embeddings=64,
            rope_parameters=longrope_parameters(8, 64),
        )
    if kind == "phi4mini":  # Phi-4-mini: LongRoPE over 3/4 of each head (12 of 16 channels), the rest passed through
        return tf.Phi3Config(
            **dict(llama, max_position_embeddings=256),
            original_max_position_embeddings=64,
            partial_rotary_factor=0.75,
            rope_parameters=longrope_parameters(6, 64, 0.75),
        )
    if kind == "smollm3":  # SmolLM3: the second layer attends without RoPE (the last of each pipeline stage at PP=2)
        return tf.SmolLM3Config(
            **llama, no_rope_layers=[1, 0], rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
        )
    gpt2 = dict(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=32,
        pad_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    if kind == "gpt2":
        return tf.GPT2Config(**gpt2)
    if kind == "gpt2_reward":
        return tf.GPT2Config(**gpt2, num_labels=1)
    raise ValueError(kind)


def hf_class(kind: str):
    import transformers as tf

    return {
        "llama": tf.LlamaForCausalLM,
        "llama_reward": tf.LlamaForSequenceClassification,
        "mistral": tf.MistralForCausalLM,
        "qwen2": tf.Qwen2ForCausalLM,
        "llama3": tf.LlamaForCausalLM,
        "llama3_reward": tf.LlamaForSequenceClassification,
        "qwen3": tf.Qwen3ForCausalLM,
        "qwen3_reward": tf.Qwen3ForSequenceClassification,
        "phi3": tf.Phi3ForCausalLM,
        "phi3_reward": tf.Phi3ForSequenceClassification,
        "phi3_longrope": tf.Phi3ForCausalLM,
        "phi4mini": tf.Phi3ForCausalLM,
        "smollm3": tf.SmolLM3ForCausalLM,
        "gpt2": tf.GPT2LMHeadModel,
        "gpt2_reward": tf.GPT2ForSequenceClassification,
    }[kind]


def make_hf(
    kind: str, directory: str | None = None, seed: int = 0, dtype=torch.float32, overrides=None, std=0.15, **save_kwargs
):
    """A tiny random HF model of `kind` (eval mode, config fields changed by `overrides`; weights of `std` around 0,
    norm weights around 1); saved with the tokenizer when `directory` is given."""
    cfg = hf_config(kind)
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = hf_class(kind)(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if ("norm" in name or "ln_" in name) and name.endswith("weight") else std * noise)
    model = model.to(dtype)
    if directory is not None:
        model.save_pretrained(directory, **save_kwargs)
        tiny_tokenizer().save_pretrained(directory)
    return model


@torch.no_grad()
def hf_outputs(model, tokens_BT: torch.Tensor = TOKENS_BT) -> torch.Tensor:
    """Logits [B,T,V] of a causal LM, or the score at every position [B,T,1] of a sequence classifier."""
    if hasattr(model, "score"):
        return model.score(model.base_model(tokens_BT).last_hidden_state)
    return model(tokens_BT).logits


def hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (safetensors, sharded or not)."""
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    )
    out = {}
    for f in files:
        out.update(load_file(os.path.join(directory, f)))
    return out


def write_bin(model, directory: str, shards: int = 2, prefix_strip: str = "") -> None:
    """Save like old transformers did: pytorch_model*.bin (+ index when sharded), optionally without the backbone
    prefix (as the original GPT-2 release was)."""
    os.makedirs(directory, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    state = {
        k[len(prefix_strip) :] if prefix_strip and k.startswith(prefix_strip) else k: v.clone()
        for k, v in model.state_dict().items()
    }
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    names = sorted(state)
    if shards == 1:
        torch.save(state, os.path.join(directory, "pytorch_model.bin"))
    else:
        weight_map = {}
        for k in range(shards):
            file = f"pytorch_model-{k + 1:05d}-of-{shards:05d}.bin"
            part = {n: state[n] for n in names[k::shards]}
            torch.save(part, os.path.join(directory, file))
            weight_map.update({n: file for n in part})
        with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    tiny_tokenizer().save_pretrained(directory)
