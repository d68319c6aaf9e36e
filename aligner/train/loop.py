"""The loop the supervised trainers share (SFT, reward model, DPO): batches -> step -> log -> validate -> checkpoint
-> stop.

Contract
- A trainer is a `Task` (below): it owns its data and model(s) and knows one optimizer step on a global batch of
  dataset indices and one validation pass. The loop owns everything around them: which examples each step takes (a
  seeded permutation per epoch: aligner.data.prompts.PromptSampler), metrics (`<exp_dir>/metrics.jsonl` with one
  object per step, TensorBoard, a progress bar), validation every `train.val_every` steps and at the last one,
  checkpoints (aligner.checkpoint.dist_ckpt: atomic, with `model.yaml`, the trainer state, the RNG and the task's
  own files), exact resume from the latest checkpoint, and clean stops: on SIGTERM / SIGUSR1 or after `max_time`
  every rank finishes its step, the job checkpoints and `fit()` returns normally (exit 0).
- Every rank constructs `SupervisedLoop(cfg, task, job)` after building the task (so a DPO reference copies the
  starting weights before a resume overwrites the policy) and calls `fit()`.
- Metrics: the task's (`train/*`, `val/*`), `timing/step` (the optimizer step), `timing/validation`, and
  `train/tokens_per_s` = the step's `train/tokens` (non-padding tokens of the whole job) / `timing/step`, and on
  GPU `memory/peak_gb` (this rank's peak allocated memory so far).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
import torch.distributed as dist

from aligner.checkpoint import dist_ckpt
from aligner.config.train import TrainJobConfig
from aligner.data.prompts import PromptSampler
from aligner.models.training import TrainableModel
from aligner.parallel import is_logging_rank, on_gpu, synchronize
from aligner.parallel.stopping import StepStopper
from aligner.utils.metrics import MetricsWriter, Progress, Timer
from aligner.utils.profiling import profiler_for

log = logging.getLogger(__name__)


class Task(Protocol):
    model: TrainableModel  # the trained model, checkpointed with its optimizer

    def num_examples(self) -> int:
        """Size of the training set (indices 0..n-1)."""
        ...

    def train_step(self, indices: list[int]) -> dict[str, float]:
        """One optimizer step on the global batch `indices` (the same list on every rank); `train/*` metrics,
        identical on every rank, including `train/tokens`. Collective."""
        ...

    def validate(self) -> dict[str, float]:
        """`val/*` metrics over the validation set ({} without one). Collective."""
        ...

    def checkpoint_files(self) -> dict[str, str]:
        """Files (name -> text) to store in the checkpoint being written. Collective."""
        ...


class SupervisedLoop:
    def __init__(self, cfg: TrainJobConfig, task: Task, job: str):
        self.cfg, self.task, self.job = cfg, task, job
        self.timer = Timer(synchronize)
        n = task.num_examples()
        self.sampler = PromptSampler(n, cfg.data.seed, cfg.data.shuffle)
        t = cfg.train
        self.num_steps = t.max_steps or max(1, t.max_epochs * n // t.global_batch_size)
        self.step = 0
        if cfg.checkpoint.resume:
            self._resume()
        self.writer = MetricsWriter(
            cfg.exp_dir, enabled=is_logging_rank(), tensorboard=cfg.logging.tensorboard, resume_step=self.step
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> str | None:
        """Train until `num_steps`, a stop signal or max_time; returns the metrics file's path (logging rank)."""
        cfg = self.cfg
        stopper = StepStopper(cfg.max_time)
        bar = Progress(self.num_steps, self.step, is_logging_rank() and cfg.logging.progress_bar, self.job)
        last_saved = self.step if dist_ckpt.latest_checkpoint(cfg.checkpoint_dir) else None
        try:
            while self.step < self.num_steps:
                with profiler_for(cfg.logging, cfg.exp_dir, self.step, dist.get_rank(), on_gpu(), self.timer):
                    metrics = self.train_step()
                if self._validation_due():
                    with self.timer("validation"):
                        metrics.update(self.task.validate())
                metrics.update(self.timer.pop())
                metrics["train/tokens_per_s"] = metrics.get("train/tokens", 0.0) / max(metrics["timing/step"], 1e-9)
                if on_gpu():
                    metrics["memory/peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                self.writer.log(self.step, metrics)
                self.step += 1
                bar.update(loss=f"{metrics['train/loss']:.4f}")
                reason = stopper.after_step()
                if reason:
                    log.warning("stopping at step %d (%s): checkpointing", self.step, reason)
                    self.save()
                    last_saved = self.step
                    break
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
                    last_saved = self.step
            if cfg.checkpoint.save_at_end and last_saved != self.step and self.step >= self.num_steps:
                self.save()
        finally:
            bar.close()
            self.writer.close()
        return self.writer.path if is_logging_rank() else None

    def train_step(self) -> dict:
        indices = self.sampler.next_batch(self.cfg.train.global_batch_size)
        with self.timer("step"):
            return self.task.train_step(indices)

    def _validation_due(self) -> bool:
        every = self.cfg.train.val_every
        return self.step + 1 == self.num_steps or bool(every and (self.step + 1) % every == 0)

    # -- checkpoints, signals -----------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        model = self.task.model
        return {
            "job": self.job,
            "sampler": self.sampler.state_dict(),
            "optimizer_steps": model.steps_taken,
            "skipped_steps": model.skipped_steps,
        }

    def save(self) -> str:
        files = self.task.checkpoint_files()
        model = self.task.model
        path = dist_ckpt.save(
            self.cfg.checkpoint_dir,
            self.step,
            [model.module],
            model.optimizer,
            self.trainer_state(),
            keep=self.cfg.checkpoint.keep,
            model_cfg=self.cfg.model,
            files=files,
        )
        log.info("checkpoint written: %s", path)
        return path

    def _resume(self) -> None:
        path = dist_ckpt.latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            return
        model = self.task.model
        state = dist_ckpt.load(path, [model.module], model.optimizer)  # the optimizer's own state, main params too
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        model.steps_taken = int(state.get("optimizer_steps", 0))
        model.skipped_steps = int(state.get("skipped_steps", 0))
        log.warning("resumed from %s at step %d", path, self.step)
