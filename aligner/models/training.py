"""A megatron model with its optimizer: the piece both jobs train (the actor's policy, the critic's value model).

Contract:
- `TrainableModel(model_cfg, optim_cfg, head)` builds this rank's slice (after `aligner.parallel.initialize`),
  wraps it in megatron's DistributedDataParallel and builds the optimizer once: megatron's (distributed) optimizer
  on GPU; on CPU, where megatron's optimizer wrappers refuse CPU tensors, torch's AdamW with the same settings,
  the same global-norm clipping (over TP x PP, each parameter counted once) and the same DP gradient sum.
- `step(micro_batches, loss_fn)` runs megatron's forward/backward schedule (pipelined when PP > 1) over the
  micro-batches, reduces gradients and takes one optimizer step. `loss_fn(batch, output) -> (loss, metrics)`
  must return a loss already normalised by the *global* count it averages over (e.g. all response tokens of
  the mini-batch on all DP ranks): gradients are summed over micro-batches and DP ranks, never averaged, so the
  sum of those pieces is exactly the full-batch mean. `metrics` is a dict of scalar tensors, summed by the caller.
- `forward(micro_batches, fn)` runs the schedule forward-only; `fn(batch, output) -> tensor` and the results
  come back per micro-batch on the last pipeline stage (an empty list on the others).
- Micro-batches are dicts with at least `tokens` [mbs, T]; under PP > 1 all must share one shape.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from aligner.config.schema import ModelConfig, OptimConfig
from aligner.models.gpt import build_gpt, position_ids_like


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warm-up to `lr`, then constant or cosine decay to `min_lr` over `lr_decay_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if not cfg.lr_decay_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class TrainableModel:
    def __init__(self, model_cfg: ModelConfig, optim_cfg: OptimConfig, head: str = "lm", trainable: bool = True):
        self.model_cfg, self.optim_cfg = model_cfg, optim_cfg
        module = build_gpt(model_cfg, head=head)
        self.config = module.config
        # Losses arrive already divided by the global token count: the schedule must not divide by the number of
        # micro-batches, and DDP must sum (not average) over data-parallel ranks.
        self.config.calculate_per_token_loss = True
        self.config.finalize_model_grads_func = None
        self.steps_taken = 0
        self.optimizer = None
        if not trainable:
            for p in module.parameters():
                p.requires_grad_(False)
            self.model = [module]
            return
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=optim_cfg.use_distributed_optimizer and torch.cuda.is_available(),
        )
        self.model = [DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)]
        self.optimizer = self._build_optimizer()

    # -- construction ------------------------------------------------------------------------------------
    def _build_optimizer(self):
        cfg = self.optim_cfg
        if torch.cuda.is_available():
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ocfg = OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                min_lr=cfg.min_lr,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.adam_beta1,
                adam_beta2=cfg.adam_beta2,
                adam_eps=cfg.adam_eps,
                clip_grad=cfg.clip_grad,
                bf16=self.config.bf16,
                fp16=self.config.fp16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=cfg.use_distributed_optimizer,
            )
            # aligner makes no gloo groups on GPU (initialize: NCCL only), so the optimizer must not ask for them.
            return get_megatron_optimizer(ocfg, self.model, use_gloo_process_groups=False)
        params = [p for p in self.model[0].parameters() if p.requires_grad]
        return torch.optim.AdamW(
            params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
        )

    @property
    def module(self):
        """The bare GPTModel (under the DDP wrapper)."""
        m = self.model[0]
        return m.module if isinstance(m, DistributedDataParallel) else m

    def load_weights(self, path: str, backbone_only: bool = False) -> None:
        """Load model weights from a dist checkpoint (any TP/PP layout), then refresh the optimizer's fp32 copies."""
        from aligner.checkpoint import dist_ckpt

        loader = dist_ckpt.load_backbone_weights if backbone_only else dist_ckpt.load_model_weights
        loader(path, [self.module])
        reload = getattr(self.optimizer, "reload_model_params", None)  # megatron's mixed-precision optimizers
        if callable(reload):
            reload()

    # -- schedule ----------------------------------------------------------------------------------------
    def _run_schedule(self, micro_batches: list[dict], fn: Callable, forward_only: bool):
        if not micro_batches:
            raise ValueError("no micro-batches to run")
        shape = micro_batches[0]["tokens"].shape
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            for mb in micro_batches:
                if mb["tokens"].shape != shape:
                    raise ValueError(
                        f"under PP all micro-batches need one shape; got {tuple(mb['tokens'].shape)} "
                        f"and {tuple(shape)}: pad them to a common length first"
                    )

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tokens = batch["tokens"]
            output = model(tokens, position_ids_like(tokens), attention_mask=None)

            def loss_func(batch, output):
                if forward_only:
                    result = fn(batch, output)
                    return torch.zeros((), device=output.device), torch.ones((), dtype=torch.int), {"out": result}
                loss, metrics = fn(batch, output)
                return loss, torch.ones((), dtype=torch.int), metrics

            return output, partial(loss_func, batch)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=self.model,
            num_microbatches=len(micro_batches),
            seq_length=shape[1],
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )

    @torch.no_grad()
    def forward(self, micro_batches: list[dict], fn: Callable) -> list:
        for m in self.model:
            m.eval()
        out = self._run_schedule(micro_batches, fn, forward_only=True)
        return [o["out"] for o in out] if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else []

    def step(self, micro_batches: list[dict], loss_fn: Callable) -> dict:
        """One optimizer step over `micro_batches`; returns {'grad_norm', 'lr', **summed loss_fn metrics}."""
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
        if torch.cuda.is_available():
            _, grad_norm, _ = self.optimizer.step()
        else:
            grad_norm = self._cpu_clip_and_step()
        self.steps_taken += 1
        metrics = {"grad_norm": float(grad_norm if grad_norm is not None else 0.0), "lr": lr}
        for out in outputs:
            for k, v in out.items():
                metrics[k] = metrics.get(k, 0.0) + float(v)
        return metrics

    def _cpu_clip_and_step(self) -> float:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        params = [p for p in self.module.parameters() if p.requires_grad]
        for p in params:
            p.grad = p.main_grad.to(p.dtype) if getattr(p, "main_grad", None) is not None else p.grad
        sq = torch.zeros((), dtype=torch.float64)
        for p in params:
            if p.grad is not None and param_is_not_tensor_parallel_duplicate(p):
                sq += p.grad.double().pow(2).sum()
        if dist.is_initialized():
            dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
        norm = float(sq.sqrt())
        clip = self.optim_cfg.clip_grad
        if clip and clip > 0 and norm > clip:
            scale = clip / (norm + 1e-6)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return norm

    # -- state -------------------------------------------------------------------------------------------
    def sharded_state_dict(self) -> dict:
        """megatron dist-checkpointing state of the model (and of the optimizer where megatron owns it)."""
        state = {"model": self.module.sharded_state_dict()}
        return state
