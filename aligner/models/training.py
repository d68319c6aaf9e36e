"""A megatron model with its optimizer: the piece every trainer trains (the actor's policy, the critic's value model).

Contract:
- `TrainableModel(model_cfg, optim_cfg, head)` builds this rank's slice (after `aligner.parallel.initialize`),
  wraps it in megatron's DistributedDataParallel and builds the optimizer once (aligner.models.optim: megatron's on
  GPU, torch's AdamW on CPU).
- Pipeline parallelism stays in here: both entry points return their results on *every* rank, broadcast from the
  last stage over the static pipeline group, so callers never ask which stage they are on.
- `forward(micro_batches, fn) -> list` runs the schedule forward-only; `fn(batch, output) -> tensor` runs on the
  last stage and its results (one per micro-batch) come back on every rank.
- `step(micro_batches, loss_fn) -> dict` runs megatron's forward/backward schedule over the micro-batches, reduces
  gradients and takes one optimizer step. `loss_fn(batch, output) -> (loss, stats)` must return a loss already
  normalised by the *global* count it averages over (e.g. all response tokens of the mini-batch on all DP ranks):
  gradients are summed over micro-batches and DP ranks, never averaged, so the sum of those pieces is exactly the
  full-batch mean. `stats` is a dict of 0-d tensors in aligner.rl.stats' convention (`tokens`, `<name>_sum`,
  `<name>_max`). Returns {'grad_norm', 'lr', 'skipped', 'stats': [one dict of floats per micro-batch]}.
  A step whose gradients are not finite anywhere in the job is skipped on every rank (no weight changes; 'skipped'
  is 1, 'grad_norm' NaN): one poisoned batch must never reach the weights.
- Micro-batches are dicts with at least `tokens` [mbs, T]; under PP > 1 all must share one shape. Optional
  `position_ids` [mbs, T] and `attention_mask` (bool [mbs, 1, T, T], True = masked out) reach the model as given
  (packed sequences, aligner.data.packing); packed rows without a mask keep attention inside their `segment_ids`
  [mbs, T] (aligner.models.attention.Segments: the SDPA attention core). By default positions count from 0 and
  attention is causal.
- `frozen`: names of parameters (e.g. `output_layer.bias`) that keep their initial or loaded values: no gradient,
  no optimizer state.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from aligner.config.schema import ModelConfig, OptimConfig
from aligner.models.attention import Segments
from aligner.models.gpt import build_gpt, pad_for_sequence_parallel, position_ids_like, sequence_multiple
from aligner.models.optim import ModelOptimizer, build_optimizer
from aligner.parallel.device import current_device, on_gpu


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warm-up to `lr`, then constant or cosine decay to `min_lr` over `lr_decay_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if not cfg.lr_decay_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# Elements a finiteness check reads at once: its boolean mask costs a byte per element, and a whole gradient buffer's
# (one byte a parameter: 2.9 GiB for a 3B model) came on top of the step's peak memory, just before Adam's.
FINITE_CHUNK = 1 << 26


def all_finite(t: torch.Tensor, chunk: int = FINITE_CHUNK) -> torch.Tensor:
    """A 0-d tensor, 1 where every element of `t` is finite (0 else), computed `chunk` elements at a time."""
    ok = torch.ones((), device=t.device)
    for piece in t.reshape(-1).split(chunk):
        ok = ok * torch.isfinite(piece).all()
    return ok


class TrainableModel:
    def __init__(
        self,
        model_cfg: ModelConfig,
        optim_cfg: OptimConfig,
        head: str = "lm",
        trainable: bool = True,
        frozen: tuple[str, ...] = (),
    ):
        self.model_cfg, self.optim_cfg = model_cfg, optim_cfg
        module = build_gpt(model_cfg, head=head)
        for name, p in module.named_parameters():  # before DDP and the optimizer: they see trainable ones only
            if name in frozen:
                p.requires_grad_(False)
        self.config = module.config
        # Losses arrive already divided by the global token count: the schedule must not divide by the number of
        # micro-batches, and DDP must sum (not average) over data-parallel ranks.
        self.config.calculate_per_token_loss = True
        self.config.finalize_model_grads_func = None
        self.steps_taken = 0
        self.skipped_steps = 0
        self.optimizer: ModelOptimizer | None = None
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        if not trainable:
            for p in module.parameters():
                p.requires_grad_(False)
            self.model = [module]
            return
        # With overlap, megatron's DDP starts each bucket's reduction (all-reduce, or reduce-scatter under the
        # distributed optimizer) from a backward hook once the bucket's last gradient of the last micro-batch is in;
        # the schedule holds it back for the earlier micro-batches (no_sync) and finalize_model_grads waits for it.
        overlap = optim_cfg.overlap_grad_reduce and parallel_state.get_data_parallel_world_size() > 1
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=optim_cfg.use_distributed_optimizer and on_gpu(),
            bucket_size=optim_cfg.grad_bucket_size if overlap else None,
        )
        ddp = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
        if overlap:
            self.config.no_sync_func, self.config.grad_sync_func = ddp.no_sync, ddp.start_grad_sync
        self.model = [ddp]
        self.optimizer = build_optimizer(self.model, self.config, optim_cfg)

    @property
    def module(self):
        """The bare GPTModel (under the DDP wrapper)."""
        m = self.model[0]
        return m.module if isinstance(m, DistributedDataParallel) else m

    def weights_loaded(self) -> None:
        """Call after the module's weights were overwritten (a checkpoint was loaded): the optimizer refreshes its
        own copies (megatron's fp32 main parameters)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # -- pipeline results --------------------------------------------------------------------------------
    def _from_last_stage(self, obj):
        """`obj` (the last stage's value) on every rank of this pipeline; identity without PP."""
        if self.pp == 1:
            return obj
        box = [obj if self.last_stage else None]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
            device=current_device(),
        )
        return box[0]

    def _tensors_from_last_stage(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-micro-batch result tensors of the last stage, on every rank: one broadcast of their shapes, one of
        their data (flat, on the device)."""
        if self.pp == 1:
            return tensors
        meta = self._from_last_stage([(tuple(t.shape), t.dtype) for t in tensors] if self.last_stage else None)
        if not meta:
            return []
        dtype = meta[0][1]
        sizes = [math.prod(shape) for shape, _ in meta]
        flat = torch.cat([t.reshape(-1).to(dtype) for t in tensors]) if self.last_stage else None
        if flat is None:
            flat = torch.empty(sum(sizes), dtype=dtype, device=current_device())
        dist.broadcast(
            flat,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
        )
        return [part.view(shape) for part, (shape, _) in zip(flat.split(sizes), meta, strict=True)]

    # -- schedule ----------------------------------------------------------------------------------------
    def _run_schedule(self, micro_batches: list[dict], fn: Callable, forward_only: bool):
        if not micro_batches:
            raise ValueError("no micro-batches to run")
        shape = micro_batches[0]["tokens"].shape
        if self.pp > 1:
            for mb in micro_batches:
                if mb["tokens"].shape != shape:
                    raise ValueError(
                        f"under PP all micro-batches need one shape; got {tuple(mb['tokens'].shape)} "
                        f"and {tuple(shape)}: pad them to a common length first"
                    )

        multiple = sequence_multiple(self.module)
        seq_length = shape[1] + (-shape[1] % multiple)

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tokens = batch["tokens"]
            T = tokens.shape[1]
            positions = batch.get("position_ids")
            tokens, positions, mask = pad_for_sequence_parallel(
                multiple,
                tokens,
                position_ids_like(tokens) if positions is None else positions,
                batch.get("attention_mask"),
            )
            segments = None
            if mask is None and "segment_ids" in batch:
                ids = F.pad(batch["segment_ids"], (0, tokens.shape[1] - T), value=-1)  # padding: a segment
                segments = Segments.of(ids, device=tokens.device)
            output = model(tokens, positions, attention_mask=mask, packed_seq_params=segments)
            if tokens.shape[1] != T and self.last_stage:
                output = output[:, :T]  # [B, T, ...]: the padding's outputs dropped

            def loss_func(batch, output):
                if forward_only:
                    result = fn(batch, output)
                    return torch.zeros((), device=output.device), torch.ones((), dtype=torch.int), {"out": result}
                loss, stats = fn(batch, output)
                return loss, torch.ones((), dtype=torch.int), {"stats": stats}

            return output, partial(loss_func, batch)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )

    @torch.no_grad()
    def forward(self, micro_batches: list[dict], fn: Callable) -> list[torch.Tensor]:
        for m in self.model:
            m.eval()
        out = self._run_schedule(micro_batches, fn, forward_only=True)
        return self._tensors_from_last_stage([o["out"] for o in out] if self.last_stage else [])

    def step(self, micro_batches: list[dict], loss_fn: Callable) -> dict:
        """One optimizer step over `micro_batches` (see the module docstring for `loss_fn` and the result)."""
        if self.optimizer is None:
            raise RuntimeError("this model was built with trainable=False")
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run_schedule(micro_batches, loss_fn, forward_only=False)
        finalize_model_grads(self.model, num_tokens=None)
        lr = lr_at(self.steps_taken, self.optim_cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self._grads_finite():
            grad_norm, skipped = self.optimizer.step(), 0
            self.steps_taken += 1
        else:
            self.optimizer.zero_grad()
            grad_norm, skipped = float("nan"), 1
            self.skipped_steps += 1
        stats = [{k: float(v) for k, v in o["stats"].items()} for o in outputs] if self.last_stage else None
        return {"grad_norm": grad_norm, "lr": lr, "skipped": skipped, "stats": self._from_last_stage(stats)}

    def _grads_finite(self) -> bool:
        """True when every gradient of every rank is finite (one MIN all-reduce over the job: all ranks must take
        the same decision, since the optimizer step itself is collective)."""
        ok = torch.ones((), device=current_device())
        for m in self.model:
            for buffer in m.buffers + m.expert_parallel_buffers:  # DDP's contiguous gradient buffers
                ok = ok * all_finite(buffer.grad_data)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())
