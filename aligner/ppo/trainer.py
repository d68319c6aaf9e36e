"""The actor job's RL loop (DESIGN.md, "One PPO step"): it orchestrates, the pieces below it do the work.

Contract: every rank of the actor job constructs `PPOTrainer(cfg)` after `aligner.parallel.initialize`, calls
`fit()`, then `close()` (before `aligner.parallel.shutdown`). Every rank holds its TP/PP slice of the policy, the
reference and the generation engine, and its DP share of the prompts, in whole groups of
`ppo.n_samples_per_prompt` samples; every rank runs the same code. Pieces chosen once, at construction:
- the advantage estimator (`ppo.advantage_estimator`, aligner.rl.estimators): gae (with the critic job's value
  model), grpo, rloo or reinforce_pp;
- the reward source (aligner.ppo.reward_sources): the critic job (values and rewards; a TrainedCritic, trained and
  checkpointed with the policy: critic_resume, critic_save, the run's commit), the critic job in reward-only mode
  (critic_infer alone), or a reward function run by this job. Who talks to whom and how answers come back is the
  source's business;
- where the KL to the reference goes (`ppo.kl.placement`): a per-token reward penalty or a loss term.
Pipeline stages are `TrainableModel`'s (its results reach every rank); metrics are reduced by name
(`aligner.rl.stats`).

One step, each phase a method with its own `timing/*` key:
  rollout (generate; the reward source starts scoring; with dynamic sampling, draws until the batch is full) ->
  log-probs of policy and reference (logprobs; the policy's pass is skipped when the update's own forward gives
  them: uses_update_logprobs) -> the reward source's answer (critic_wait_infer from the critic job,
  reward_wait from this job's reward function) -> advantages (advantages) -> critic_train sent (gae) -> policy
  update (train) -> refit -> critic_train metrics awaited (critic_wait_train) -> log, sample dump, validation,
  checkpoint.
Whenever the critic job is used (also in reward-only mode, without critic_wait_train), `timing/critic_wait` is the
sum of the two waits for it.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner import rl
from aligner.checkpoint import dist_ckpt, run
from aligner.config import ConfigError
from aligner.config.actor import ActorJobConfig
from aligner.critic.protocol import CriticCheckpointError
from aligner.critic.remote import Pending
from aligner.data.prompts import PromptDataset, PromptSampler, pad_prompts
from aligner.data.tokenizer import load_tokenizer
from aligner.generation import ReleasableMemory, SamplingParams, build_engine
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.training import TrainableModel
from aligner.parallel import current_device, is_logging_rank, on_gpu, synchronize
from aligner.parallel.stopping import StepStopper
from aligner.parallel.watchdog import PhaseWatchdog
from aligner.ppo.reference import build_reference
from aligner.ppo.reward_sources import TrainedCritic, build_reward_source
from aligner.ppo.rollout import (
    Rollout,
    assemble,
    by_row,
    concat,
    expand_groups,
    gather_rollout,
    micro_batches,
    minibatch_positions,
    pad_to,
    sample_seeds,
    select_rows,
)
from aligner.utils.metrics import MetricsWriter, Progress, Timer
from aligner.utils.profiling import profiler_for

log = logging.getLogger(__name__)

# The metric the adaptive KL controller reads, in the units of its target (ppo.kl.target_units).
KL_METRIC = {"sample": "ppo/kl_per_sample", "token": "ppo/kl"}


class PPOTrainer:
    def __init__(self, cfg: ActorJobConfig):
        self.cfg = cfg
        self.dp = cfg.validate_world(dist.get_world_size())
        self.dp_rank, self.dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.device = current_device()
        rank = dist.get_rank()
        self.watchdog = PhaseWatchdog(cfg.parallel.timeout_minutes * 60, lambda: f"rank {rank}, step {self.step}:")
        self.timer = Timer(synchronize, watch=self.watchdog)

        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}: they must match the checkpoint the policy was built from"
            )
        d, max_prompt = cfg.data, cfg.generation.max_prompt_length
        keys = dict(
            prompt_key=d.prompt_key, label_key=d.label_key, messages_key=d.messages_key, long_prompts=d.long_prompts
        )
        self.train_data = PromptDataset(d.train_file, self.tokenizer, max_prompt, **keys)
        self.val_data = PromptDataset(d.val_file, self.tokenizer, max_prompt, **keys) if d.val_file else None
        self.sampler = PromptSampler(len(self.train_data), d.seed, d.shuffle)

        self.policy = TrainableModel(cfg.model, cfg.optim, head="lm")
        if cfg.model.checkpoint:
            dist_ckpt.load_model_weights(cfg.model.checkpoint, [self.policy.module])
            self.policy.weights_loaded()
        self.reference = build_reference(cfg.reference.mode, cfg.model, self.policy)
        self.engine = build_engine(cfg.generation, cfg.model, self.policy.module)
        p, k = cfg.ppo, cfg.ppo.kl
        self.group_size = p.n_samples_per_prompt
        self.estimator = rl.make_estimator(
            p.advantage_estimator,
            self.group_size,
            gamma=p.gamma,
            lam=p.lam,
            whiten=p.whiten_advantages,
            normalize_std=p.normalize_group_std,
            score_clip=p.score_clip,
        )
        self.kl_ctl = rl.make_kl_controller(k.coef, k.adaptive, k.target, k.horizon)
        self.step = 0
        self.reward = build_reward_source(cfg, self.dp_group, self.tokenizer)
        # The value model the loop trains and checkpoints (gae: the critic job's), or None.
        self.critic = self.reward if isinstance(self.reward, TrainedCritic) else None
        # Whether the critic job takes part in the run's checkpoints (critic_resume, critic_save, the commit): only
        # with a value model. A reward-only critic has no state (it serves neither endpoint) and a reward function
        # none at all: the run's commit record then covers the actor alone.
        self.saves_critic = self.critic is not None and cfg.checkpoint.save_critic
        # The wait for the scores: the critic job's (critic_wait_infer, with or without a value model) or this job's
        # own reward function's (reward_wait).
        self.reward_wait = "reward_wait" if cfg.reward.source == "function" else "critic_wait_infer"
        self._resume()
        self.writer = MetricsWriter(
            cfg.exp_dir, enabled=is_logging_rank(), tensorboard=cfg.logging.tensorboard, resume_step=self.step
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> str | None:
        """Run until ppo.num_steps, SIGTERM or max_time; returns the path of the metrics file (logging rank)."""
        cfg = self.cfg
        stopper = StepStopper(cfg.max_time)
        bar = Progress(cfg.ppo.num_steps, self.step, is_logging_rank() and cfg.logging.progress_bar, "ppo")
        last_saved = self.step if self.resumed else None
        try:
            while self.step < cfg.ppo.num_steps:
                with profiler_for(cfg.logging, cfg.exp_dir, self.step, dist.get_rank(), on_gpu(), self.timer):
                    metrics = self.train_step()
                if cfg.validation.every and self.val_data and (self.step + 1) % cfg.validation.every == 0:
                    with self.timer("validation"):
                        metrics.update(self.validate())
                metrics.update(self._timings())
                self.writer.log(self.step, metrics)
                self.step += 1
                bar.update(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{metrics['ppo/kl']:.4f}")
                reason = stopper.after_step()
                if reason:
                    log.warning("stopping at step %d (%s): checkpointing", self.step, reason)
                    self.save()
                    last_saved = self.step
                    break
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
                    last_saved = self.step
            if cfg.checkpoint.save_at_end and last_saved != self.step and self.step >= cfg.ppo.num_steps:
                self.save()
        finally:
            bar.close()
            self.writer.close()
        return self.writer.path if is_logging_rank() else None

    def train_step(self) -> dict:
        cfg = self.cfg
        with self.timer("step"):
            with self.timer("generate"):
                rollout, scoring, metrics = self.generate_rollouts()  # scoring: the reward source's pending answer
                if cfg.generation.release_kv_cache and isinstance(self.engine, ReleasableMemory):
                    self.engine.release_memory()  # taken back by the next _generate
            on_policy = self.uses_update_logprobs()
            overlap = cfg.critic.overlap or self.reward_wait != "critic_wait_infer"
            if not overlap:  # the critic job's GPU work first, then the actor's (one GPU, no time-slicing)
                with self.timer(self.reward_wait):
                    values_BT, scores_B = scoring.result()
            with self.timer("logprobs"):
                logp_BS, ref_logp_BS = self.compute_logprobs(rollout, policy=not on_policy)
            if overlap:
                with self.timer(self.reward_wait):
                    values_BT, scores_B = scoring.result()
            with self.timer("advantages"):
                batch, step_metrics = self.compute_advantages(rollout, logp_BS, ref_logp_BS, values_BT, scores_B)
            metrics.update(step_metrics)
            metrics["ppo/update_logprobs_reused"] = float(on_policy)
            critic_training = self.critic.train(rollout, batch["returns"], batch["values"]) if self.critic else None
            if critic_training is not None and not overlap:
                with self.timer("critic_wait_train"):
                    metrics.update(critic_training.result())
                critic_training = None
            if self.step >= cfg.ppo.critic_warmup_steps:
                with self.timer("train"):
                    metrics.update(self.update_policy(rollout, batch))
                if on_policy:  # the rollout's KL in the units of the other path's ppo/kl_per_sample
                    metrics["ppo/kl_per_sample"] = (
                        metrics["ppo/kl"] * metrics["rollout/tokens"] / metrics["rollout/samples"]
                    )
                with self.timer("refit"):
                    self.engine.refit(self.policy.module)
            if critic_training is not None:
                with self.timer("critic_wait_train"):
                    metrics.update(critic_training.result())
            self.kl_ctl.update(metrics[KL_METRIC[cfg.ppo.kl.target_units]], metrics["rollout/samples"])
            if cfg.logging.samples_every and self.step % cfg.logging.samples_every == 0:
                self.dump_samples(rollout, scores_B)
        return metrics

    def _timings(self) -> dict:
        out = self.timer.pop()
        if self.reward_wait == "critic_wait_infer":  # the critic job's: critic_wait is the sum of the waits for it
            out["timing/critic_wait"] = out.get("timing/critic_wait_infer", 0.0) + out.get(
                "timing/critic_wait_train", 0.0
            )
        return out

    # -- phases -------------------------------------------------------------------------------------------
    def _my_positions(self, n: int, groups: int, seed: int | None) -> list[int]:
        return minibatch_positions(n, groups, self.dp, self.dp_rank, seed)

    def _generate(self, prompts, positions, sampling_kw, step_seed, seed_offset: int = 0) -> Rollout:
        """Generate for `prompts` in engine-sized chunks of whole groups; returns the assembled rollout. A sample's
        seed comes from (seed, step_seed, seed_offset + its position)."""
        chunk = self.cfg.generation.max_batch_size // self.group_size * self.group_size
        if isinstance(self.engine, ReleasableMemory):
            self.engine.acquire_memory()  # a no-op unless generation.release_kv_cache freed it
        parts = []
        for lo in range(0, len(prompts), chunk):
            sub = prompts[lo : lo + chunk]
            tokens_BP, lengths_B = pad_prompts(sub, self.tokenizer.pad_id)
            tokens_BP, lengths_B = tokens_BP.to(self.device), lengths_B.to(self.device)
            sampling = SamplingParams(
                **sampling_kw,
                eos_token_id=self.tokenizer.eos_id,
                stop_token_ids=self.tokenizer.stop_ids,
                pad_token_id=self.tokenizer.pad_id,
                seeds=sample_seeds(self.cfg.seed, step_seed, [seed_offset + i for i in positions[lo : lo + chunk]]),
            )
            out = self.engine.generate(tokens_BP, lengths_B, sampling)
            total = int((lengths_B + out.response_lengths_B).max())
            part = assemble(
                tokens_BP,
                lengths_B,
                out.response_tokens_BR,
                out.response_lengths_B,
                out.logprobs_BR,
                out.ended_B,
                self.tokenizer.pad_id,
                total,
            )
            part.labels = [p.label for p in sub]
            part.positions = list(positions[lo : lo + chunk])
            parts.append(part)
        rollout = concat(parts, self.tokenizer.pad_id)
        # One sequence length across DP ranks: the critic gets one [B, T] batch and shapes stay static.
        width = torch.tensor([rollout.tokens_BT.shape[1]], device=self.device)
        dist.all_reduce(width, op=dist.ReduceOp.MAX)
        return pad_to(rollout, int(width), self.tokenizer.pad_id)

    def _sampling_kw(self, greedy: bool | None = None) -> dict:
        s = self.cfg.sampling
        return dict(
            greedy=s.greedy if greedy is None else greedy,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            min_new_tokens=s.min_new_tokens,
            max_new_tokens=s.max_new_tokens,
            ignore_eos=s.ignore_eos,
        )

    def generate_rollouts(self) -> tuple[Rollout, Pending, dict]:
        """This rank's share of the step's groups (engine = last refit), the reward source's pending answer for them,
        and metrics of the drawing. With dynamic sampling the answer is already in: the filter needs the scores."""
        if self.cfg.ppo.dynamic_sampling.enabled:
            return self._draw_until_full()
        rollout = self._draw(0)
        return rollout, self.reward.score(rollout), {}

    def _draw(self, draw: int) -> Rollout:
        """Draw `ppo.rollout_batch_size` prompts; generate `ppo.n_samples_per_prompt` responses to each of this
        rank's (whole groups, laid out by global mini-batch: `_my_positions`). Draw d > 0 (dynamic sampling) has its
        own layout and seeds."""
        p, n = self.cfg.ppo, self.group_size
        global_indices = self.sampler.next_batch(p.rollout_batch_size)
        layout_seed = self.cfg.seed * 7 + self.step + 7919 * draw
        groups = self._my_positions(len(global_indices), p.num_mini_batches, layout_seed)
        prompts = [self.train_data.items[global_indices[g]] for g in groups for _ in range(n)]
        offset = draw * p.rollout_batch_size * n  # draws never share a sample seed
        return self._generate(prompts, expand_groups(groups, n), self._sampling_kw(), self.step, offset)

    def _draw_until_full(self) -> tuple[Rollout, Pending, dict]:
        """DAPO's dynamic sampling: keep the groups whose scores differ, draw again until `ppo.rollout_batch_size`
        are kept or `max_draws` is reached (dropped groups then fill the rest, in draw order). Every rank sees every
        draw's rows (gathered over DP) and picks the same groups, so the batch does not depend on the DP size."""
        p, n = self.cfg.ppo, self.group_size
        G, pad = p.rollout_batch_size, self.tokenizer.pad_id
        kept, dropped = [], []  # (rollout of one draw, its scores, group index) in draw order
        draws = constant = 0
        while len(kept) < G and draws < p.dynamic_sampling.max_draws:
            rollout = self._draw(draws)
            _, scores_B = self.reward.score(rollout).result()
            whole, scores = gather_rollout(rollout, scores_B, self.dp_group, pad)
            flat = rl.constant_groups(scores, n).tolist()
            for g, same in enumerate(flat):
                (dropped if same else kept).append((whole, scores, g))
            constant += sum(flat)
            draws += 1
        chosen = (kept + dropped)[:G]
        batch = concat([select_rows(w, list(range(g * n, (g + 1) * n))) for w, _, g in chosen], pad)
        scores = torch.cat([sc[g * n : (g + 1) * n] for _, sc, g in chosen])
        rows = expand_groups(self._my_positions(G, p.num_mini_batches, self.cfg.seed * 7 + self.step), n)
        batch.positions = list(range(G * n))
        mine = select_rows(batch, rows, device=self.device)
        my_scores = scores[rows].to(self.device)
        metrics = {"rollout/draws": float(draws), "rollout/drawn_zero_std_group_fraction": constant / (draws * G)}
        return mine, Pending(lambda: (None, my_scores)), metrics

    def _micro_batches(
        self, rollout: Rollout, rows: list[int] | None = None, size: int | None = None, **per_token
    ) -> list[dict]:
        p = self.cfg.ppo
        multiple = p.trim_padding if self.policy.pp == 1 else 0  # PP: one shape for every micro-batch
        size = size or p.micro_batch_size
        return micro_batches(rollout, rows, size, multiple, p.micro_batch_tokens, **per_token)

    def _logprobs_fn(self, batch, logits_BTV):
        return vocab_parallel_logprobs(
            logits_BTV[:, :-1],
            batch["tokens"][:, 1:],
            self.tp_group,
            temperature=self.cfg.sampling.logprob_temperature,
            vocab_size=self.cfg.model.vocab_size,
        )

    def uses_update_logprobs(self) -> bool:
        """Whether this step takes the "old" log-probs from the policy update's own forward (issue 17).

        With one epoch of one mini-batch the policy has not changed between rollout scoring and the update's
        forward, so that forward's log-probs are the old ones (ratio exactly 1) and a separate policy pass repeats
        it. Nothing before the update may need them: the KL must be a loss term (or have a fixed coefficient of 0),
        and the update must run this step (not a critic warm-up step)."""
        p = self.cfg.ppo
        kl_needed_before = p.kl.placement == "reward" and (p.kl.coef != 0.0 or p.kl.adaptive)
        return (
            p.reuse_update_logprobs
            and p.epochs == 1
            and p.num_mini_batches == 1
            and not kl_needed_before
            and self.step >= p.critic_warmup_steps
        )

    def compute_logprobs(self, rollout: Rollout, policy: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Log-probs [B, T-1] of the sampled tokens under the policy (training layout; None with `policy=False`)
        and the reference. Without the policy pass the reference runs on the update's micro-batches (same rows,
        same shapes), so its log-probs match the update's bit for bit while the weights are equal (KL 0 at step 0)."""
        p = self.cfg.ppo
        micro = self._micro_batches(rollout, size=p.forward_micro_batch_size if policy else p.micro_batch_size)
        B, S = rollout.mask_BS.shape
        logp = by_row(micro, self.policy.forward(micro, self._logprobs_fn), B, S) if policy else None
        return logp, by_row(micro, self.reference.forward(micro, self._logprobs_fn), B, S)

    def compute_advantages(self, rollout, logp_BS, ref_logp_BS, values_BT, scores_B) -> tuple[dict, dict]:
        """Rewards, advantages and returns of this rank's rows (the estimator's), and the rollout metrics."""
        cfg, mask = self.cfg.ppo, rollout.mask_BS
        values_BS = values_BT[:, :-1] * mask if values_BT is not None else None
        # Without the policy's log-probs (uses_update_logprobs: the KL is no reward term) the KL and mismatch
        # metrics come from the update (update_policy).
        on_policy = logp_BS is None
        kl_BS = (
            torch.zeros_like(ref_logp_BS)
            if on_policy
            else rl.kl_estimate(logp_BS, ref_logp_BS, cfg.kl.estimator, cfg.kl.use_absolute_kl)
        )
        reward_kl_coef = self.kl_ctl.value if cfg.kl.placement == "reward" else 0.0
        penalty_B = torch.zeros_like(scores_B)
        if cfg.overlong.buffer:
            penalty_B = rl.overlong_penalty(
                rollout.response_lengths_B, self.cfg.max_new_tokens, cfg.overlong.buffer, cfg.overlong.penalty
            ).to(scores_B.device)
        advantages_BS, returns_BS = self.estimator(
            scores_B + penalty_B, kl_BS, mask, reward_kl_coef, values_BS, group=self.dp_group
        )
        # Rollout statistics over the whole job (sums and counts all-reduced over DP, by name).
        rewards_BS = rl.per_token_rewards(scores_B + penalty_B, kl_BS, mask, reward_kl_coef, cfg.score_clip)
        sums = {} if on_policy else self._logprob_sums(logp_BS, ref_logp_BS, rollout.engine_logp_BS, mask)
        sums |= {
            "tokens": mask.sum(),
            "score": scores_B.sum(),
            "score_sq": (scores_B**2).sum(),
            "samples": float(len(scores_B)),
            "response_length": rollout.response_lengths_B.float().sum(),
            "ended": rollout.ended_B.float().sum(),
            "token_reward": (rewards_BS * mask).sum(),
            "overlong_penalty": penalty_B.sum(),
        }
        if values_BS is not None:
            sums["value"] = (values_BS * mask).sum()
        if self.group_size > 1:  # whole groups per rank: counted locally, summed over DP
            sums["constant_groups"] = rl.constant_groups(scores_B, self.group_size).float().sum()
        s = rl.sum_by_name(sums, group=self.dp_group)
        n, tokens = s["samples"], s["tokens"]
        metrics = {
            "rollout/reward_mean": s["score"] / n,
            "rollout/reward_std": math.sqrt(max(0.0, s["score_sq"] / n - (s["score"] / n) ** 2)),
            "rollout/response_length_mean": s["response_length"] / n,
            "rollout/ended_fraction": s["ended"] / n,
            "rollout/samples": n,
            "rollout/tokens": tokens,
            "rollout/token_reward_mean": s["token_reward"] / tokens,
            "ppo/kl_coef": self.kl_ctl.value,
        }
        if not on_policy:
            top = rl.max_by_name({"mismatch": (rollout.engine_logp_BS - logp_BS).abs().mul(mask).amax()}, self.dp_group)
            metrics |= {
                "ppo/kl": s["kl"] / tokens,
                "ppo/kl_per_sample": s["kl"] / n,
                "ppo/kl_k3": s["kl_k3"] / tokens,
                "ppo/logprob_mismatch": s["mismatch"] / tokens,
                "ppo/logprob_mismatch_max": top["mismatch"],
                "ppo/ratio_error": s["ratio_error"] / tokens,
            }
        if "value" in s:
            metrics["rollout/value_mean"] = s["value"] / tokens
        if "constant_groups" in s:
            metrics["rollout/zero_std_group_fraction"] = s["constant_groups"] / (n / self.group_size)
        if cfg.overlong.buffer:
            metrics["rollout/overlong_penalty_mean"] = s["overlong_penalty"] / n
        batch = {"advantages": advantages_BS.detach(), "returns": returns_BS.detach()}
        if on_policy:  # the update measures the rollout's KL and mismatch against these
            batch |= {"engine_logp": rollout.engine_logp_BS, "ref_logp": ref_logp_BS.detach()}
        else:
            batch["old_logp"] = logp_BS.detach()
        if cfg.rollout_correction_cap is not None:  # the engine's log-probs weight the policy gradient
            batch["engine_logp"] = rollout.engine_logp_BS
        if values_BS is not None:
            batch["values"] = values_BS.detach()
        if cfg.kl.placement == "loss":
            batch["ref_logp"] = ref_logp_BS.detach()
        return batch, metrics

    @staticmethod
    def _logprob_sums(logp_BS, ref_logp_BS, engine_logp_BS, mask_BS) -> dict:
        """Sums over the response tokens of the KL to the reference (k1, k3) and of the engine/training log-prob
        differences: the rollout's KL and mismatch metrics (`ppo/kl`, `ppo/logprob_mismatch`, `ppo/ratio_error`)."""
        return {
            "kl": ((logp_BS - ref_logp_BS) * mask_BS).sum(),
            "kl_k3": (rl.kl_estimate(logp_BS, ref_logp_BS, "k3") * mask_BS).sum(),
            "mismatch": ((engine_logp_BS - logp_BS).abs() * mask_BS).sum(),
            "ratio_error": ((torch.exp(logp_BS - engine_logp_BS) - 1).abs() * mask_BS).sum(),
        }

    def update_policy(self, rollout: Rollout, batch: dict) -> dict:
        """ppo.epochs passes of ppo.num_mini_batches optimizer steps over this step's rollouts."""
        cfg = self.cfg.ppo
        B = rollout.batch_size
        per_mini = B // cfg.num_mini_batches
        stats, grad_norms, skipped, real, computed, count = [], [], 0, 0.0, 0.0, 0
        g = torch.Generator().manual_seed(self.cfg.seed * 31 + self.step)
        for epoch in range(cfg.epochs):
            # Epoch 0 keeps the global mini-batches laid out by _my_positions; later epochs reshuffle locally.
            order = list(range(B)) if epoch == 0 else torch.randperm(B, generator=g).tolist()
            for m in range(cfg.num_mini_batches):
                rows = order[m * per_mini : (m + 1) * per_mini]
                micro = self._micro_batches(rollout, rows, **batch)
                real += float(rollout.lengths_B[rows].sum())
                computed += float(sum(mb["tokens"].numel() for mb in micro))
                count += len(micro)
                keep = [rl.policy_loss_mask(mb["mask"], mb["ended"], cfg.zero_unended) for mb in micro]
                num_tokens = max(1, rl.global_token_count(keep, group=self.dp_group))
                result = self.policy.step(micro, lambda mb, logits, n=num_tokens: self._policy_loss(mb, logits, n))
                stats += result["stats"]
                grad_norms.append(result["grad_norm"])
                skipped += result["skipped"]
        rollout_stats = [{k: s.pop(k) for k in list(s) if k.startswith("rollout_")} for s in stats]
        reduced = rl.reduce_stats(stats, group=self.dp_group)
        counts = rl.sum_by_name({"real": real, "computed": computed, "micro": count}, group=self.dp_group)
        optimizer_steps = cfg.epochs * cfg.num_mini_batches
        metrics = {
            "ppo/padding_fraction": 1.0 - counts["real"] / counts["computed"],
            "ppo/micro_batches": counts["micro"] / optimizer_steps,  # an optimizer step's, all ranks together
        }
        if "kl_loss" in reduced:
            metrics["ppo/kl_loss"] = reduced["kl_loss"]
        if any(rollout_stats):  # uses_update_logprobs: the rollout's KL and mismatch, measured by the update
            r = rl.reduce_stats(rollout_stats, group=self.dp_group, count="rollout_tokens")
            metrics |= {
                "ppo/kl": r["rollout_kl"],
                "ppo/kl_k3": r["rollout_kl_k3"],
                "ppo/logprob_mismatch": r["rollout_mismatch"],
                "ppo/logprob_mismatch_max": r["rollout_mismatch_max"],
                "ppo/ratio_error": r["rollout_ratio_error"],
            }
        if "is_weight" in reduced:  # ppo.rollout_correction_cap (the stats' "rollout_" names are the rollout's own)
            metrics |= {
                "ppo/rollout_weight_mean": reduced["is_weight"],
                "ppo/rollout_weight_max": reduced["is_weight_max"],
            }
        return metrics | {
            "ppo/policy_loss": reduced["pg_loss"],
            "ppo/clipfrac": reduced["clipfrac"],
            "ppo/entropy": reduced["entropy"],
            "ppo/approx_kl": reduced["approx_kl"],
            "ppo/ratio_mean": reduced["ratio"],
            "ppo/ratio_max": reduced["ratio_max"],
            "ppo/grad_norm": float(np.nanmean(grad_norms)) if skipped < len(grad_norms) else float("nan"),
            "ppo/skipped_steps": float(skipped),
            "ppo/lr": self.policy.optimizer.param_groups[0]["lr"],
        }

    def _policy_loss(self, mb: dict, logits_BTV: torch.Tensor, num_tokens: int):
        cfg = self.cfg.ppo
        logp, entropy = vocab_parallel_logprobs(
            logits_BTV[:, :-1],
            mb["tokens"][:, 1:],
            self.tp_group,
            temperature=self.cfg.sampling.logprob_temperature,
            vocab_size=self.cfg.model.vocab_size,
            with_entropy=True,
        )
        on_policy = "old_logp" not in mb  # uses_update_logprobs: this forward's own log-probs are the old ones
        old_logp = logp.detach() if on_policy else mb["old_logp"]
        loss, stats = rl.policy_loss(
            logp,
            old_logp,
            mb["advantages"],
            mb["mask"],
            num_tokens,
            clip_eps=cfg.clip_eps,
            clip_eps_high=cfg.clip_eps_high,
            dual_clip=cfg.dual_clip,
            entropy_BT=entropy,
            entropy_coef=cfg.entropy_coef,
            ended_B=mb["ended"],
            zero_unended=cfg.zero_unended,
            # the KL as a loss term (ppo.kl.placement: loss); mb["ref_logp"] is also there to measure the rollout's KL
            ref_logp_BT=mb["ref_logp"] if cfg.kl.placement == "loss" else None,
            kl_coef=self.kl_ctl.value if cfg.kl.placement == "loss" else 0.0,
            kl_estimator=cfg.kl.estimator,
            rollout_logp_BT=mb.get("engine_logp"),
            rollout_weight_cap=cfg.rollout_correction_cap,
        )
        if on_policy:
            mask = mb["mask"]
            sums = self._logprob_sums(old_logp, mb["ref_logp"], mb["engine_logp"], mask)
            stats |= {f"rollout_{k}_sum": v.to(torch.float64) for k, v in sums.items()}
            stats["rollout_tokens"] = mask.sum().to(torch.float64)
            stats["rollout_mismatch_max"] = ((mb["engine_logp"] - old_logp).abs() * mask).amax().to(torch.float64)
        return loss, stats

    def dump_samples(self, rollout: Rollout, scores_B: torch.Tensor) -> None:
        if not self.writer.enabled:
            return
        rows = []
        for b in range(min(self.cfg.logging.num_samples, rollout.batch_size)):
            p, n = int(rollout.prompt_lengths_B[b]), int(rollout.lengths_B[b])
            ids = rollout.tokens_BT[b].tolist()
            rows.append(
                {
                    "prompt": self.tokenizer.decode(ids[:p]),
                    "response": self.tokenizer.decode(ids[p:n]),
                    "reward": float(scores_B[b]),
                    "ended": bool(rollout.ended_B[b]),
                }
            )
        self.writer.samples(self.step, rows)

    def validate(self) -> dict:
        """Generate for the held-out prompts (greedy or sampled) and score them with the reward source."""
        items = self.val_data.items[: self.cfg.validation.max_prompts]
        n = (len(items) // self.dp) * self.dp
        if n == 0:
            return {}
        positions = self._my_positions(n, 1, None)
        sampling = self._sampling_kw(self.cfg.validation.greedy)
        rollout = self._generate([items[i] for i in positions], positions, sampling, 10_000_000 + self.step)
        _, scores = self.reward.score(rollout).result()
        s = rl.sum_by_name(
            {
                "reward": scores.sum(),
                "response_length": rollout.response_lengths_B.float().sum(),
                "ended": rollout.ended_B.float().sum(),
            },
            group=self.dp_group,
        )
        return {
            "val/reward_mean": s["reward"] / n,
            "val/response_length_mean": s["response_length"] / n,
            "val/ended_fraction": s["ended"] / n,
        }

    # -- checkpoints, signals, teardown -----------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {
            "run_id": self.run_id,
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "optimizer_steps": self.policy.steps_taken,
        }

    def save(self) -> None:
        """Checkpoint step `self.step` with the critic (when it takes part: `saves_critic`), then commit it
        (aligner.checkpoint.run): a step becomes a resume point only once both jobs have written it (the actor alone
        in a run without a trained critic). A failed critic_save fails here, on every rank."""
        with self.watchdog.phase("checkpoint"):
            self._save()

    def _save(self) -> None:
        cfg = self.cfg.checkpoint
        critic_saved = self.critic.save(self.step, self.run_id) if self.saves_critic else None
        path = dist_ckpt.save(
            self.cfg.checkpoint_dir,
            self.step,
            [self.policy.module],
            self.policy.optimizer,
            self.trainer_state(),
            keep=cfg.keep,
            model_cfg=self.cfg.model,
        )
        if critic_saved is not None:
            critic_saved.result()
        self.commit = self.commit.add(self.step, cfg.keep)
        run.commit(self.cfg.checkpoint_dir, self.commit)
        log.info("checkpoint written and committed: %s", path)

    def _resume(self) -> None:
        """Start run `self.run_id` fresh, or resume the newest committed step both jobs can load."""
        cfg, root = self.cfg.checkpoint, self.cfg.checkpoint_dir
        self.resumed = False
        committed = run.read(root)
        if committed is not None and not cfg.resume:
            raise ConfigError(
                "checkpoint.resume",
                f"{root} holds run {committed.run_id} (committed steps {committed.steps}): set "
                "checkpoint.resume=true to continue it, or use another exp_dir",
            )
        if committed is None:
            if dist_ckpt.complete_checkpoints(root):
                log.warning("%s holds checkpoints but no commit record (%s): starting fresh", root, run.RECORD)
            self.run_id = run.agreed_run_id()
            self.commit = run.Commit(self.run_id)
            if self.saves_critic:
                self.critic.resume(None, self.run_id)
            return
        self.run_id, self.commit = committed.run_id, committed
        for step, path, problem in run.resume_points(root, committed):
            if problem is None and self.saves_critic:
                try:
                    self.critic.resume(step, self.run_id)
                except CriticCheckpointError as exc:
                    problem = f"the critic cannot resume it: {exc}"
            if problem is not None:
                log.warning("not resuming from committed step %d: %s", step, problem)
                continue
            state = dist_ckpt.load(path, [self.policy.module], self.policy.optimizer)
            self.step = int(state["step"])
            self.sampler.load_state_dict(state["sampler"])
            self.kl_ctl.load_state_dict(state["kl_controller"])
            self.policy.steps_taken = int(state.get("optimizer_steps", 0))
            self.engine.refit(self.policy.module)
            self.resumed = True
            log.warning("resumed from %s at step %d", path, self.step)
            return
        raise dist_ckpt.CheckpointError(
            f"none of the committed steps {committed.steps} of run {self.run_id} in {root} can be resumed (see the "
            "warnings above): restore them, or start a new run in another exp_dir"
        )

    def close(self) -> None:
        """Free the engine (its CUDA graphs hold the TP communicator: before shutdown) and the reward source."""
        self.engine.close()
        self.reward.close()
