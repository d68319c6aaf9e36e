"""Throughput of the supervised trainers (SFT, reward model, DPO) as users run them: the real entry script on a
synthetic workload, timed by the trainer's own metrics.

`write_workload(dir, trainer, ...)` writes, deterministically and without downloads, a word-level tokenizer.json with
the model's vocabulary (one token per word `w<i>`) and a JSONL training file: SFT rows of `prompt_tokens` +
`response_tokens` (packing fills the rows), preference rows with a shared prompt and two responses. `run(...)`
starts `scripts/train_<trainer>.py --config-name <config>` (torchrun for several processes) for `steps` steps
without validation or checkpoints and summarises `metrics.jsonl` over the steps after `warmup`: median s/step,
tokens/s (non-padding tokens of the whole job), model TFLOP/s by 6·N·tokens (forward+backward; DPO's resident
reference adds 2·N·tokens), and the peak GPU memory. scripts/bench_trainers.py is the entry point.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def write_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(path)


def _words(rng: random.Random, n: int, vocab_size: int) -> str:
    return " ".join(f"w{rng.randrange(vocab_size - len(SPECIALS))}" for _ in range(n))


def write_workload(
    out_dir: str, trainer: str, rows: int, prompt_tokens: int, response_tokens: int, vocab_size: int, seed: int = 0
) -> tuple[str, str]:
    """(tokenizer.json, train.jsonl) under `out_dir` (see the module docstring)."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer, data = os.path.join(out_dir, "tokenizer.json"), os.path.join(out_dir, f"{trainer}.jsonl")
    write_tokenizer(tokenizer, vocab_size)
    rng = random.Random(seed)
    with open(data, "w") as f:
        for _ in range(rows):
            row = {"prompt": _words(rng, prompt_tokens, vocab_size)}
            if trainer == "sft":
                row["response"] = " " + _words(rng, response_tokens, vocab_size)
            else:
                row["chosen"] = " " + _words(rng, response_tokens, vocab_size)
                row["rejected"] = " " + _words(rng, response_tokens, vocab_size)
            f.write(json.dumps(row) + "\n")
    return tokenizer, data


def _model_params(cfg) -> int:
    """Parameters of the ModelConfig's model (dense; a gated MLP's three matrices as its family says; embeddings
    counted once per matrix)."""
    from aligner.families import family

    h, layers, ffn = cfg.hidden_size, cfg.num_layers, cfg.ffn_hidden_size or 4 * cfg.hidden_size
    groups = cfg.num_query_groups or cfg.num_attention_heads
    kv = 2 * h * (h // cfg.num_attention_heads) * groups
    mlp = (3 if family(cfg.arch).gated_mlp else 2) * h * ffn
    per_layer = h * h + kv + h * h + mlp
    embeddings = cfg.vocab_size * h * (1 if cfg.tie_embeddings else 2)
    return layers * per_layer + embeddings


def run(
    trainer: str,
    config: str,
    steps: int,
    warmup: int,
    procs: int,
    overrides: list[str],
    workload: dict,
    exp_dir: str | None = None,
) -> dict:
    """Run the trainer on the synthetic workload; returns the summary (see the module docstring)."""
    sys.path.insert(0, ROOT)
    from aligner.config.dpo import load_dpo_config
    from aligner.config.reward_model import load_reward_model_config
    from aligner.config.sft import load_sft_config

    loader = {"sft": load_sft_config, "reward_model": load_reward_model_config, "dpo": load_dpo_config}[trainer]
    exp_dir = exp_dir or tempfile.mkdtemp(prefix=f"bench_{trainer}_")
    data_dir = os.path.join(exp_dir, "data")
    probe = loader(["--config-name", config, "data.train_file=" + __file__, "data.tokenizer=" + __file__, *overrides])
    tokenizer, data = write_workload(data_dir, trainer, vocab_size=probe.model.vocab_size, **workload)
    args = [
        "--config-name",
        config,
        f"exp_dir={exp_dir}",
        f"data.train_file={data}",
        f"data.tokenizer={tokenizer}",
        f"train.max_steps={steps}",
        "train.val_every=0",
        "data.val_file=null",
        "checkpoint.save_at_end=false",
        "checkpoint.resume=false",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        *overrides,
    ]
    script = os.path.join(ROOT, "scripts", f"train_{trainer}.py")
    head = (
        [sys.executable] if procs == 1 else [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={procs}"]
    )
    proc = subprocess.run(head + [script, *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{trainer} failed (status {proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(os.path.join(exp_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][warmup:]
    if not rows:
        raise RuntimeError(f"no steps after the {warmup} warm-up steps: raise --steps")
    step_s = statistics.median(r["timing/step"] for r in rows)
    tokens = statistics.median(r["train/tokens"] for r in rows)
    n_params = _model_params(probe.model)
    passes = 8 if trainer == "dpo" and probe.dpo.reference == "resident" else 6  # reference forward: 2·N·tokens
    return {
        "trainer": trainer,
        "config": config,
        "overrides": overrides,
        "procs": procs,
        "workload": workload,
        "params": n_params,
        "steps_timed": len(rows),
        "s_per_step": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": passes * n_params * tokens / step_s / 1e12,
        "padding_fraction": statistics.median(r.get("train/padding_fraction", 0.0) for r in rows),
        "peak_memory_gb": max((r.get("memory/peak_gb") or 0.0) for r in rows) or None,
        "final_loss": rows[-1]["train/loss"],
    }


def format_row(r: dict) -> str:
    mem = f"{r['peak_memory_gb']:.1f}" if r["peak_memory_gb"] else "-"
    return (
        f"| {r['trainer']} | {r['procs']} | {r['s_per_step']:.3f} | {r['tokens_per_s']:,.0f} | "
        f"{r['model_tflops_per_s']:.1f} | {r['padding_fraction']:.3f} | {mem} |"
    )
