"""Conversion between Hugging Face checkpoints and aligner's megatron dist checkpoints, both ways.

A converted directory (what `convert_hf_to_dist` writes, and what actor/critic configs point `model.checkpoint` at):
    <dir>/model/            megatron dist checkpoint of the GPTModel (as aligner.checkpoint.dist_ckpt writes it)
    <dir>/model.yaml        the ModelConfig section (checkpoint: <dir>, tokenizer: <dir>/tokenizer)
    <dir>/tokenizer/        the HF tokenizer files, byte for byte
    <dir>/hf_config.json    the source config.json, kept so the reverse conversion is exact
    <dir>/conversion.json   model_type (policy | reward), source, architecture, validated --tp/--pp
    <dir>/generation_config.json  when the source had one
It is written under `<parent>/.tmp-<name>` and renamed into place at the end: nothing half-written on error.

- `convert_hf_to_dist(...)` is collective. In one process it builds the model at TP=1/PP=1 and the given --tp/--pp
  are only validated and recorded (dist checkpoints reshard on load, so any layout loads it). Launched on
  exactly tp*pp ranks (torchrun, srun, mpiexec), each rank builds its TP/PP slice and reads only the HF tensors it
  needs, which spreads the memory. Tensors stream one at a time from the HF files into the parameters: memory is
  one model (or one slice) plus one layer.
- `convert_dist_to_hf(...)` runs in one process: it loads the dist checkpoint (any layout it was saved in) into a
  TP=1/PP=1 model and writes HF tensors layer by layer into size-capped safetensors shards (one model plus one
  shard in memory). The model config comes from `model.yaml` (in the checkpoint directory, or `model_config`),
  the exact HF config from `hf_config.json` beside it when present; a policy or reward head is read off the
  checkpoint itself, so a critic trained from a policy exports as `*ForSequenceClassification`.
megatron's vocabulary padding: rows are padded for the layout on load (zeros) and cut back to `vocab_size` on
export; the tokenizer may have fewer ids than the embedding rows (HF models often pad), never more.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from aligner.checkpoint import dist_ckpt
from aligner.checkpoint.hf import (
    SUPPORTED,
    CheckpointMismatchError,
    UnsupportedModelError,
    architecture_of,
    detect_prefix,
    embedding_name,
    hf_config_for_export,
    model_config_from_hf,
    normalized_hf_config,
    weight_map,
)
from aligner.checkpoint.hf_io import (
    HFReader,
    SafetensorsWriter,
    copy_extras,
    copy_tokenizer,
    parse_size,
    tokenizer_size,
)
from aligner.config.schema import ModelConfig
from aligner.models.dtypes import DTYPE_NAMES, NAMES, torch_dtype

MARKER = "conversion.json"
HEADS = {"policy": "lm", "reward": "scalar"}

# What the converter scripts report as a one-line user error (bad input, missing files) instead of a traceback.
USER_ERRORS = (UnsupportedModelError, CheckpointMismatchError, FileNotFoundError, FileExistsError, ValueError)


# -- process groups and atomic directories ---------------------------------------------------------------------


def _dist():
    import torch.distributed as dist

    return dist if dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _barrier() -> None:
    if _dist():
        _dist().barrier()


def _agree(error: BaseException | None) -> None:
    """Raise on every rank if any rank failed, so that no rank waits forever in a later collective: the failing
    rank re-raises its own exception, the others a RuntimeError naming it."""
    d = _dist()
    if d is not None and d.get_world_size() > 1:
        messages = [None] * d.get_world_size()
        d.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}")
        failed = [(r, m) for r, m in enumerate(messages) if m]
        if failed and error is None:
            raise RuntimeError(f"conversion failed on rank {failed[0][0]}: {failed[0][1]}")
    if error is not None:
        raise error


def _initialize(tp: int, pp: int) -> None:
    from aligner.parallel import initialize
    from aligner.parallel.launch import discover

    port = None
    if _dist() is None and discover().source == "single":
        import socket

        # A lone process needs a process group too; a free port keeps concurrent conversions apart.
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    initialize(tp, pp, master_port=port)


def _world_size() -> int:
    from aligner.parallel.launch import discover

    d = _dist()
    return d.get_world_size() if d else discover().world_size


def _tmp_path(final: str) -> str:
    return os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final))


def _check_output(final: str, overwrite: bool, source: str) -> None:
    out, src = os.path.realpath(final), os.path.realpath(source)
    if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise ValueError(
            f"--output {final} {'is' if out == src else 'overlaps'} the input {source}: writing there would "
            "delete the source; choose an output directory outside it"
        )
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{final} exists: remove it or pass --overwrite")
    parent = os.path.dirname(final)
    if parent and not os.path.isdir(parent):
        raise FileNotFoundError(f"the parent directory of the output, {parent}, does not exist")


def _commit(tmp: str, final: str) -> None:
    if os.path.exists(final):
        old = final + ".old-" + str(os.getpid())
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


# -- HF -> megatron ---------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
    if not os.path.isdir(hf_dir):
        raise FileNotFoundError(f"{hf_dir} is not a directory: pass a Hugging Face checkpoint directory")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {hf_dir}: pass a directory written by save_pretrained")
    with open(path) as f:
        return json.load(f)


def _resolve_dtype(dtype: str, reader: HFReader, probe: str) -> str:
    if dtype != "auto":
        if dtype not in NAMES:
            raise ValueError(f"--dtype {dtype!r}: use auto, {', '.join(NAMES)}")
        return dtype
    stored = reader.dtype(probe)
    if stored not in DTYPE_NAMES:
        raise UnsupportedModelError(f"{probe} is stored as {stored}: pass --dtype {'|'.join(NAMES)}")
    return DTYPE_NAMES[stored]


def _validate_hf_tensors(reader: HFReader, wmap) -> None:
    """Every tensor the mapping reads exists with the shape the config implies; nothing else is left over."""
    have = set(reader.names())
    expected = wmap.all_hf_shapes()
    missing = sorted(set(expected) - have)
    if missing:
        raise CheckpointMismatchError(
            f"the HF checkpoint lacks {len(missing)} tensor(s) its config implies, e.g. "
            f"{missing[:4]}: the download is incomplete or config.json does not match"
        )
    for name, shape in expected.items():
        if reader.shape(name) != tuple(shape):
            raise CheckpointMismatchError(
                f"{name} has shape {reader.shape(name)} but config.json implies "
                f"{tuple(shape)}: config.json does not describe these weights"
            )
    hf = wmap.spec.hf
    tied_head = {f"{hf.lm_head}.weight"} if wmap.cfg.tie_embeddings else set()
    # Buffers, not weights (recomputed by the model), which some HF files carry.
    extra = sorted(n for n in have - set(expected) - tied_head if not n.endswith(hf.buffers))
    if extra:
        raise UnsupportedModelError(
            f"the HF checkpoint has {len(extra)} tensor(s) the megatron model has no place "
            f"for, e.g. {extra[:4]}: converting would silently drop them"
        )


def _validate_layout(cfg: ModelConfig, tp: int, pp: int) -> None:
    groups = cfg.num_query_groups or cfg.num_attention_heads
    if tp < 1 or pp < 1:
        raise ValueError("--tp and --pp must be >= 1")
    if cfg.num_attention_heads % tp or groups % tp:
        raise ValueError(
            f"--tp {tp} must divide num_attention_heads={cfg.num_attention_heads} and the number of KV heads={groups}"
        )
    if cfg.num_layers % pp:
        raise ValueError(f"--pp {pp} must divide num_layers={cfg.num_layers}")


def load_hf_into(module: torch.nn.Module, cfg: ModelConfig, wmap, read) -> None:
    """Stream HF tensors (`read(hf_name)`) into this rank's TP/PP slice of `module`, part by part."""
    from megatron.core import parallel_state as ps

    from aligner.models.gpt import padded_vocab_size
    from aligner.models.sharding import local_layer_range, shard_state_dict

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == pp - 1
    tied_lm = cfg.tie_embeddings and wmap.model_type == "policy"
    parts = ["pre"] if first or (last and tied_lm) else []  # the last stage holds a copy of a tied embedding
    parts += list(local_layer_range(cfg.num_layers, pp_rank, pp))
    parts += ["post"] if last else []
    own = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    padded = padded_vocab_size(cfg.vocab_size, cfg.make_vocab_size_divisible_by, tp)
    filled = set()
    with torch.no_grad():
        for part in parts:
            full = wmap.to_megatron(part, read)
            # The scalar head is replicated over TP and never vocabulary-padded: keep it out of the LM rules.
            replicated = {
                k: full.pop(k)
                for k in ("output_layer.weight", "output_layer.bias")
                if wmap.model_type == "reward" and k in full
            }
            local = shard_state_dict(
                full, cfg.num_layers, wmap.spec.gated_mlp, tp_rank, tp, pp_rank, pp, tied_lm, padded
            )
            local.update(replicated)
            for name, src in local.items():
                if name not in own:
                    if name == "output_layer.weight" and tied_lm:
                        continue  # tied on a single stage: the embedding is the output layer
                    raise KeyError(f"mapped tensor {name} has no parameter in the megatron model")
                if tuple(src.shape) != tuple(own[name].shape):
                    raise CheckpointMismatchError(
                        f"{name}: converted shape {tuple(src.shape)} != model shape {tuple(own[name].shape)}"
                    )
                own[name].copy_(src)
                filled.add(name)
            del full, local
    unfilled = sorted(set(own) - filled)
    if unfilled:
        raise RuntimeError(f"no HF tensor was mapped to {unfilled[:4]}: the weight map is incomplete")


def _build(cfg: ModelConfig, model_type: str):
    from aligner.models.gpt import build_gpt

    # The local layer spec on every machine: its parameter names are the ones the weight map and sharding rules
    # use, and its dist-checkpoint keys are Transformer Engine's, so either spec loads the result.
    return build_gpt(dataclasses.replace(cfg, attention_backend="sdpa", checkpoint=None), head=HEADS[model_type])


def convert_hf_to_dist(
    hf_dir: str,
    out_dir: str,
    model_type: str | None = None,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "auto",
    tokenizer: str | None = None,
    max_position_embeddings: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
) -> str:
    """Convert the HF checkpoint in `hf_dir` into a converted directory at `out_dir` (see module docstring).

    Collective when launched on several ranks (then exactly tp*pp of them). Returns the absolute output path.
    """
    from megatron.core import dist_checkpointing

    from aligner.config.loader import to_yaml

    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    raw = read_hf_config(hf_dir)
    arch = architecture_of(raw)
    family_name, native_type = SUPPORTED[arch]
    if model_type is not None and model_type != native_type:
        raise UnsupportedModelError(
            f"--model-type {model_type} but {hf_dir} holds a {arch} ({native_type}): reward models come from "
            "*ForSequenceClassification with one label, policies from *ForCausalLM / GPT2LMHeadModel"
        )
    reader = HFReader(hf_dir)
    prefix = detect_prefix(family_name, reader.names())
    probe = embedding_name(family_name, prefix)
    cfg, _, model_type = model_config_from_hf(
        normalized_hf_config(raw), _resolve_dtype(dtype, reader, probe), max_position_embeddings
    )
    cfg.make_vocab_size_divisible_by = make_vocab_size_divisible_by
    wmap = weight_map(cfg, model_type, prefix)
    _validate_hf_tensors(reader, wmap)
    tokenizer_src = os.path.abspath(tokenizer) if tokenizer else hf_dir
    n_tokens = tokenizer_size(tokenizer_src)
    if n_tokens > cfg.vocab_size:
        raise CheckpointMismatchError(
            f"the tokenizer in {tokenizer_src} has {n_tokens} tokens but the embedding has {cfg.vocab_size} rows: ids "
            f">= {cfg.vocab_size} would index past it; use the model's own tokenizer or resize the embeddings in HF "
            "first (model.resize_token_embeddings(len(tokenizer)))"
        )
    _validate_layout(cfg, tp, pp)
    _check_output(out_dir, overwrite, hf_dir)
    world = _world_size()
    if world == 1:
        build_tp, build_pp = 1, 1
    elif world == tp * pp:
        build_tp, build_pp = tp, pp
    else:
        raise ValueError(
            f"launched on {world} ranks: run the converter as one process or on exactly --tp x --pp = {tp * pp} ranks"
        )
    _initialize(build_tp, build_pp)

    tmp = _tmp_path(out_dir)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted conversion
        os.makedirs(os.path.join(tmp, "model"))
    _barrier()
    error = None
    try:
        module = _build(cfg, model_type)
        load_hf_into(module, cfg, wmap, reader.get)
    except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree below
        error = exc
    finally:
        reader.close()
    try:
        _agree(error)
        dist_ckpt.use_local_results_queue()  # no writer helper process (dist_ckpt.save does the same)
        dist_checkpointing.save(module.sharded_state_dict(), os.path.join(tmp, "model"))
        _barrier()
        error = None
        if _rank() == 0:
            try:
                final_cfg = dataclasses.replace(cfg, checkpoint=out_dir, tokenizer=os.path.join(out_dir, "tokenizer"))
                copy_tokenizer(tokenizer_src, os.path.join(tmp, "tokenizer"))
                # generation_config.json's EOS ids (one or a list) next to the tokenizer: load_tokenizer's stop_ids
                copy_extras(hf_dir, os.path.join(tmp, "tokenizer"))
                # transformers picks a tokenizer class from the model's config.json too (e.g. Qwen2's adds
                # <|endoftext|>): a copy beside the tokenizer files makes AutoTokenizer load the same tokenizer.
                with open(os.path.join(tmp, "tokenizer", "config.json"), "w") as f:
                    json.dump(raw, f, indent=2)
                copy_extras(hf_dir, tmp)
                with open(os.path.join(tmp, "hf_config.json"), "w") as f:
                    json.dump(raw, f, indent=2)
                with open(os.path.join(tmp, "model.yaml"), "w") as f:
                    f.write(f"# converted from {hf_dir} ({arch}, {model_type}) by scripts/convert_hf_to_nemo.py\n")
                    f.write(to_yaml(final_cfg))
                with open(os.path.join(tmp, MARKER), "w") as f:
                    json.dump(
                        {
                            "model_type": model_type,
                            "architecture": arch,
                            "source": hf_dir,
                            "tokenizer_size": n_tokens,
                            "params_dtype": cfg.params_dtype,
                            "tensor_model_parallel_size": tp,
                            "pipeline_model_parallel_size": pp,
                            "converted_with_layout": [build_tp, build_pp],
                        },
                        f,
                        indent=1,
                    )
                dist_ckpt.write_manifest(tmp)  # a later truncated file is named, not loaded
                _commit(tmp, out_dir)
            except Exception as exc:  # noqa: BLE001 - reported to every rank by _agree below
                error = exc
        _agree(error)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# -- megatron -> HF ---------------------------------------------------------------------------------------------


def _model_dir(ckpt_dir: str) -> str:
    model_dir = dist_ckpt.model_dir(ckpt_dir)
    if not os.path.isfile(os.path.join(model_dir, "metadata.json")):
        raise FileNotFoundError(
            f"{ckpt_dir} is not an aligner checkpoint: no megatron dist checkpoint (metadata.json) "
            "in it or in its model/ directory"
        )
    problem = dist_ckpt.verify(ckpt_dir) if os.path.isfile(os.path.join(ckpt_dir, "state.json")) else None
    problem = problem or dist_ckpt.verify_files(ckpt_dir)
    if problem:
        raise dist_ckpt.CheckpointError(problem)
    return model_dir


def find_model_yaml(ckpt_dir: str, model_config: str | None = None) -> str:
    """`model_config` (a YAML file or a directory holding model.yaml), else `<ckpt_dir>/model.yaml`."""
    candidates = [model_config] if model_config else [ckpt_dir]
    for c in candidates:
        path = os.path.join(c, "model.yaml") if os.path.isdir(c) else c
        if os.path.isfile(path):
            return os.path.abspath(path)
    where = model_config or ckpt_dir
    raise FileNotFoundError(
        f"no model.yaml at {where}: pass --model-config with the model.yaml of the converted "
        "directory the job started from (or any YAML of the model's ModelConfig section)"
    )


def load_model_yaml(path: str) -> ModelConfig:
    from aligner.config import load_config, validate_model

    cfg = load_config(ModelConfig, path)
    validate_model(cfg)
    return cfg


def detect_model_type(model_dir: str) -> str:
    """'reward' for a scalar head (reward model or critic), 'policy' for an LM head (see dist_ckpt.head_kind)."""
    return "reward" if dist_ckpt.head_kind(model_dir) == "scalar" else "policy"


def _hf_tensors(module, cfg: ModelConfig, wmap):
    """(hf_name, tensor) for the whole model, part by part, from a TP=1/PP=1 module (vocabulary padding cut)."""
    own = module.state_dict()

    def read(name: str) -> torch.Tensor:
        if name not in own:
            raise KeyError(f"the megatron model has no {name}")
        t = own[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight") and t.shape[0] > 1:
            t = t[: cfg.vocab_size]
        return t

    for part in wmap.parts():
        yield from wmap.to_hf(part, read).items()


def convert_dist_to_hf(
    ckpt_dir: str,
    out_dir: str,
    model_config: str | None = None,
    model_type: str | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    tokenizer: str | None = None,
    drop_score_bias: bool = False,
    overwrite: bool = False,
) -> str:
    """Export an aligner checkpoint (converted dir or a trained step dir) as an HF directory; one process."""
    from aligner.checkpoint.dist_ckpt import load_model_weights

    ckpt_dir, out_dir = os.path.abspath(ckpt_dir), os.path.abspath(out_dir)
    model_dir = _model_dir(ckpt_dir)
    yaml_path = find_model_yaml(ckpt_dir, model_config)
    cfg = load_model_yaml(yaml_path)
    conv_dir = os.path.dirname(yaml_path)
    source = None
    if os.path.isfile(os.path.join(conv_dir, "hf_config.json")):
        with open(os.path.join(conv_dir, "hf_config.json")) as f:
            source = json.load(f)
    detected = detect_model_type(model_dir)
    if model_type is not None and model_type != detected:
        raise CheckpointMismatchError(
            f"--model-type {model_type} but {ckpt_dir} holds a {detected} model "
            f"({'scalar' if detected == 'reward' else 'language-model'} head)"
        )
    model_type = detected
    dtype = dtype or cfg.params_dtype
    if dtype not in NAMES:
        raise ValueError(f"--dtype {dtype!r}: use {', '.join(NAMES)}")
    hf_cfg = hf_config_for_export(cfg, model_type, source, dtype)
    tokenizer_src = tokenizer or cfg.tokenizer
    if tokenizer_src:
        if not os.path.exists(tokenizer_src):
            raise FileNotFoundError(
                f"tokenizer {tokenizer_src} (from {'--tokenizer' if tokenizer else yaml_path}) "
                "does not exist: pass --tokenizer DIR"
            )
        n_tokens = tokenizer_size(tokenizer_src)
        if n_tokens > cfg.vocab_size:
            raise CheckpointMismatchError(
                f"the tokenizer {tokenizer_src} has {n_tokens} tokens but the model's "
                f"vocabulary has {cfg.vocab_size} rows: it is not this model's tokenizer"
            )
    _check_output(out_dir, overwrite, ckpt_dir)
    if _world_size() != 1:
        raise ValueError(
            "run the megatron -> HF converter as one process: the checkpoint is resharded to TP=1/PP=1 "
            "on load, whatever layout saved it"
        )
    _initialize(1, 1)

    module = _build(cfg, model_type)
    dist_ckpt.check_matches(model_dir, [module], vocab_size=cfg.vocab_size, described_by=yaml_path)
    load_model_weights(ckpt_dir, [module], vocab_size=cfg.vocab_size)
    if model_type == "reward":
        bias = float(module.output_layer.bias.detach().float().reshape(()))
        if bias != 0.0 and not drop_score_bias:
            raise UnsupportedModelError(
                f"the scalar head has bias {bias:g}, but HF's score layer has none: pass --drop-score-bias to export "
                f"anyway (every HF score is then lower by {bias:g}; rankings are unchanged)"
            )
    wmap = weight_map(cfg, model_type)
    tmp = _tmp_path(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        writer = SafetensorsWriter(tmp, parse_size(max_shard_size))
        with torch.no_grad():
            for name, tensor in _hf_tensors(module, cfg, wmap):
                writer.add(name, tensor.to(torch_dtype(dtype)))
        writer.close()
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)
        if tokenizer_src:
            copy_tokenizer(tokenizer_src, tmp)
        copy_extras(conv_dir, tmp)
        _commit(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
