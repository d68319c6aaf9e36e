"""Offline generation (`scripts/generate.py`): one response per prompt of a file, from a checkpoint's policy.

Contract
- `generate_file(opts)` is collective: every rank of the job calls it after `aligner.parallel.initialize(opts.tp,
  opts.pp)`. The checkpoint is a converted HF model (`scripts/convert_hf_to_nemo.py`) or an actor job checkpoint
  (`<exp>/checkpoints/step_N`); both carry `model.yaml`, which gives the model's shape. The model and its tokenizer
  are found as a job's `model.checkpoint` finds them (`aligner.config.from_checkpoint`): `opts.tokenizer`, else
  `<checkpoint>/tokenizer/`, else the tokenizer model.yaml names (an actor checkpoint: its converted model's). Prompts
  are read and rendered exactly as the actor job's dataset does (`aligner.data.prompts`: plain prompts or chats,
  docs/DATA.md).
- The world is split into data-parallel groups of TP x PP ranks; group d generates prompts d, d + DP, d + 2 DP, ...
  with the native engine (`aligner.generation.build_engine`) in batches of `opts.batch_size`. Sampled draws depend
  only on the prompt's position in the file (`seed + index`), never on the batch or the layout.
- Global rank 0 writes `opts.output`: one JSON line per input line, in order, `{"prompt", "response",
  "response_token_ids"}` (the rendered prompt text, the decoded response without special tokens, the generated ids
  with the ending EOS or stop token when one was generated). Written to a temporary file, then renamed: a failed run
  leaves no partial output.
- Responses end at the tokenizer's EOS and its `stop_ids` (the `eos_token_id`s of the generation_config.json beside
  the tokenizer files, which conversion copies there), as the actor's rollouts and HF's `generate` do, or after
  `max_new_tokens`. Greedy decoding in float32 equals HF `generate(do_sample=False)`.
- User mistakes raise ConfigError (a bad option, named by its flag) or DataError (a bad prompt file or row).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Literal, Optional

from aligner.config.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class OfflineOptions:
    checkpoint: str  # a converted model or an actor job checkpoint (both hold model.yaml)
    prompts: str  # JSONL, Parquet or a saved HF dataset directory (docs/DATA.md)
    output: str  # the JSONL file to write
    max_new_tokens: int
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # sample i (0-based position in the file) draws with seed + i
    batch_size: int = 32  # prompts per generate() call of each data-parallel group
    tp: int = 1
    pp: int = 1
    tokenizer: Optional[str] = None
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    long_prompts: Literal["error", "truncate_left"] = "error"  # skipping would break one output line per input line
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # the engine's weights (auto: see generation)

    def validate(self, world_size: int = 1) -> None:
        """Rules the options alone decide (the model's are checked by `generate_file`); ConfigError names the flag."""
        if self.tp < 1 or self.pp < 1:
            raise ConfigError("--tp/--pp", f"must be >= 1, got --tp {self.tp} --pp {self.pp}")
        if world_size % (self.tp * self.pp):
            raise ConfigError("--tp/--pp", f"{world_size} ranks are not a multiple of TP x PP = {self.tp * self.pp}")
        if self.max_new_tokens < 1:
            raise ConfigError("--max-new-tokens", f"must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            raise ConfigError("--temperature", f"must be > 0 (or use --greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("--top-p", f"must be in (0, 1] (1 disables top-p), got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError("--top-k", f"must be >= 0 (0 disables top-k), got {self.top_k}")
        if self.batch_size < 1:
            raise ConfigError("--batch-size", f"must be >= 1, got {self.batch_size}")
        if self.long_prompts not in ("error", "truncate_left"):
            raise ConfigError("--long-prompts", f"must be error or truncate_left, got {self.long_prompts!r}")
        if os.path.isdir(self.output):
            raise ConfigError("--output", f"{self.output} is a directory: give a file name")
        parent = os.path.dirname(os.path.abspath(self.output))
        if not os.path.isdir(parent):
            raise ConfigError("--output", f"the directory {parent} does not exist")


def _model_config(checkpoint: str):
    from aligner.checkpoint import dist_ckpt
    from aligner.config.from_checkpoint import read_checkpoint_model
    from aligner.config.schema import validate_model

    if not os.path.isfile(os.path.join(dist_ckpt.model_dir(checkpoint), "metadata.json")):
        raise ConfigError(
            "--checkpoint",
            f"{checkpoint} is not an aligner checkpoint (no model/metadata.json): give the output of "
            "scripts/convert_hf_to_nemo.py or an actor checkpoint <exp>/checkpoints/step_N",
        )
    found = read_checkpoint_model(checkpoint)
    if found is None:
        raise ConfigError("--checkpoint", f"{checkpoint} has no model.yaml: its model's shape is unknown")
    if dist_ckpt.head_kind(checkpoint) == "scalar":
        raise ConfigError(
            "--checkpoint", f"{checkpoint} holds a reward model or critic (a scalar head): generation needs a policy"
        )
    validate_model(found[1])
    return found[1]


def _tokenizer(opts: OfflineOptions, cfg):
    """The checkpoint's tokenizer, found as a job's `model.checkpoint` finds it, unless `--tokenizer` names one."""
    from aligner.config.from_checkpoint import checkpoint_tokenizer
    from aligner.data.tokenizer import load_tokenizer

    if opts.tokenizer and not os.path.exists(opts.tokenizer):
        raise ConfigError("--tokenizer", f"{opts.tokenizer} does not exist")
    path = opts.tokenizer or checkpoint_tokenizer(opts.checkpoint, cfg)
    if path is None:
        raise ConfigError(
            "--tokenizer",
            f"{opts.checkpoint} has no tokenizer/ and its model.yaml names none that exists "
            f"({cfg.tokenizer!r}): pass --tokenizer (a tokenizer.json or an HF tokenizer directory)",
        )
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ConfigError(
            "--tokenizer", f"{path} has {tokenizer.vocab_size} tokens but the model {cfg.vocab_size}: not this model's"
        )
    return tokenizer


def _build(opts: OfflineOptions, cfg, longest_prompt: int, batch_size: int):
    """This rank's slice of the policy, loaded, and an engine over it."""
    from aligner.checkpoint import dist_ckpt
    from aligner.config.generation import GenerationConfig
    from aligner.generation import build_engine
    from aligner.models.gpt import build_gpt

    policy = build_gpt(cfg, head="lm")
    dist_ckpt.load_model_weights(opts.checkpoint, [policy])
    policy.eval()
    gen_cfg = GenerationConfig(
        max_batch_size=batch_size,
        max_prompt_length=longest_prompt,
        max_response_length=opts.max_new_tokens,
        dtype=opts.dtype,
    )
    return build_engine(gen_cfg, cfg, policy)


def _write_atomically(path: str, lines) -> None:
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def generate_file(opts: OfflineOptions) -> int:
    """Generate a response for every prompt of `opts.prompts` into `opts.output`; returns the number written.
    Collective (module docstring)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from aligner.config.schema import ParallelConfig, validate_layout
    from aligner.data.prompts import PromptDataset, pad_prompts
    from aligner.generation import SamplingParams
    from aligner.parallel import current_device, host_barrier

    opts.validate(dist.get_world_size())
    cfg = _model_config(opts.checkpoint)
    try:
        dp = validate_layout(cfg, ParallelConfig(opts.tp, opts.pp), dist.get_world_size())
    except ConfigError as exc:
        raise ConfigError("--tp/--pp", str(exc).split(": ", 1)[-1]) from None
    budget = cfg.max_position_embeddings - opts.max_new_tokens
    if budget < 1:
        raise ConfigError(
            "--max-new-tokens",
            f"{opts.max_new_tokens} leaves no room for a prompt in the model's {cfg.max_position_embeddings} positions",
        )
    tokenizer = _tokenizer(opts, cfg)
    data = PromptDataset(
        opts.prompts,
        tokenizer,
        budget,
        prompt_key=opts.prompt_key,
        messages_key=opts.messages_key,
        long_prompts=opts.long_prompts,
    )
    items = data.items
    dp_rank = ps.get_data_parallel_rank()
    mine = list(range(dp_rank, len(items), dp))
    batch_size = min(opts.batch_size, max(1, -(-len(items) // dp)))
    engine = _build(opts, cfg, max(len(p.ids) for p in items), batch_size)
    device = current_device()
    results: list[tuple[int, list[int]]] = []
    try:
        for lo in range(0, len(mine), batch_size):
            index = mine[lo : lo + batch_size]
            tokens_BP, lengths_B = pad_prompts([items[i] for i in index], tokenizer.pad_id)
            sampling = SamplingParams(
                greedy=opts.greedy,
                temperature=opts.temperature,
                top_k=opts.top_k,
                top_p=opts.top_p,
                max_new_tokens=opts.max_new_tokens,
                eos_token_id=tokenizer.eos_id,
                stop_token_ids=tokenizer.stop_ids,
                pad_token_id=tokenizer.pad_id,
                seeds=[opts.seed + i for i in index],
            )
            out = engine.generate(tokens_BP.to(device), lengths_B.to(device), sampling)
            tokens, lengths = out.response_tokens_BR.cpu(), out.response_lengths_B.cpu()
            results += [(i, tokens[b, : int(lengths[b])].tolist()) for b, i in enumerate(index)]
    finally:
        engine.close()
    # Every rank of a TP x PP group holds the same responses: the group's first rank speaks for it.
    first_of_group = ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(results if first_of_group else [], gathered, dst=0)
    if dist.get_rank() == 0:
        responses = dict(pair for part in gathered for pair in part)
        assert sorted(responses) == list(range(len(items))), "every prompt answered exactly once"
        _write_atomically(
            opts.output,
            (
                {"prompt": p.text, "response": tokenizer.decode(responses[i]), "response_token_ids": responses[i]}
                for i, p in enumerate(items)
            ),
        )
        log.info("%s: %d responses (%d prompts truncated)", opts.output, len(items), data.truncated)
    host_barrier()  # every rank returns once rank 0's output file is in place
    return len(items)


__all__ = ["OfflineOptions", "generate_file"]
