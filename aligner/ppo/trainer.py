"""The actor job's PPO loop (DESIGN.md, "One PPO step").

Contract: every rank of the actor job constructs `PPOTrainer(cfg)` after `aligner.parallel.initialize` and calls
`fit()`. Every rank holds its TP slice of the policy, the reference and the generation engine, and its DP share of
the prompts. Global rank 0 alone talks to the critic job: it gathers the whole batch over DP (cheap: token ids),
sends one request, and broadcasts the answer; requests are futures, so the critic computes while the actor computes.

One step, each phase a method with its own `timing/*` key:
  rollout (generate) -> critic_infer sent -> log-probs of policy and reference (logprobs) -> critic answer awaited
  (critic_wait) -> rewards, GAE, whitening (advantages) -> critic_train sent -> policy update (train) -> refit
  -> critic_train metrics awaited -> log, sample dump, validation, checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from aligner import rl
from aligner.checkpoint import dist_ckpt
from aligner.config.actor import ActorJobConfig
from aligner.data.prompts import PromptDataset, PromptSampler, pad_prompts
from aligner.data.tokenizer import load_tokenizer
from aligner.generation import SamplingParams, build_engine
from aligner.models.logprobs import vocab_parallel_logprobs
from aligner.models.training import TrainableModel
from aligner.ppo.reference import build_reference
from aligner.ppo.rollout import Rollout, assemble, concat, minibatch_positions, pad_to, sample_seeds
from aligner.utils.metrics import MetricsWriter, Timer

log = logging.getLogger(__name__)


class PPOTrainer:
    def __init__(self, cfg: ActorJobConfig):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.dp = cfg.validate_world(dist.get_world_size())
        self.dp_rank, self.dp_group = ps.get_data_parallel_rank(), ps.get_data_parallel_group()
        self.tp_group = ps.get_tensor_model_parallel_group()
        # Pipeline parallelism: the engine generates on every stage (all layers gathered, see the engine); the
        # training schedule's outputs (log-probs, loss statistics) exist on the last stage and are broadcast from it.
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group() if self.pp > 1 else None
        self.pp_last_rank = ps.get_pipeline_model_parallel_last_rank()
        self.last_stage = ps.is_pipeline_last_stage()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.timer = Timer(torch.cuda.synchronize if torch.cuda.is_available() else None)
        self.stop_requested = False

        self.tokenizer = load_tokenizer(cfg.tokenizer_path)
        if self.tokenizer.vocab_size > cfg.model.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens but model.vocab_size is "
                f"{cfg.model.vocab_size}: they must match the checkpoint the policy was built from"
            )
        max_prompt = cfg.generation.max_prompt_length
        self.train_data = PromptDataset(
            cfg.data.train_file, self.tokenizer, max_prompt, cfg.data.prompt_key, cfg.data.label_key, cfg.data.add_bos
        )
        self.val_data = (
            PromptDataset(
                cfg.data.val_file, self.tokenizer, max_prompt, cfg.data.prompt_key, cfg.data.label_key, cfg.data.add_bos
            )
            if cfg.data.val_file
            else None
        )
        self.sampler = PromptSampler(len(self.train_data), cfg.data.seed, cfg.data.shuffle)

        self.policy = TrainableModel(cfg.model, cfg.optim, head="lm")
        if cfg.model.checkpoint:
            self.policy.load_weights(cfg.model.checkpoint)
        self.reference = build_reference(cfg.reference.mode, cfg.model, self.policy.module)
        self.engine = build_engine(cfg.generation, cfg.model, self.policy.module)
        self.kl_ctl = rl.make_kl_controller(cfg.ppo.kl.coef, cfg.ppo.kl.adaptive, cfg.ppo.kl.target, cfg.ppo.kl.horizon)
        self.step = 0
        self.critic = None
        if self.rank == 0:
            from aligner.critic.client import CriticClient

            self.critic = CriticClient.from_config(cfg.critic)
            self.critic.wait_ready()
        self._resume()
        dist_ckpt.start_writer()  # not inside the first checkpoint (the critic saves at the same time)
        self.writer = MetricsWriter(
            cfg.logging.exp_dir, enabled=self.rank == 0, tensorboard=cfg.logging.tensorboard, resume_step=self.step
        )

    # -- the loop -----------------------------------------------------------------------------------------
    def fit(self) -> str | None:
        """Run until ppo.num_steps, SIGTERM or max_time; returns the path of the metrics file (rank 0)."""
        cfg = self.cfg
        self._install_signal_handlers()
        start = time.monotonic()
        bar = None
        if self.rank == 0 and cfg.logging.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.ppo.num_steps, initial=self.step, desc="ppo", dynamic_ncols=True)
        last_saved = self.step if dist_ckpt.latest_checkpoint(cfg.checkpoint_dir) else None
        try:
            while self.step < cfg.ppo.num_steps:
                metrics = self.train_step()
                if cfg.validation.every and self.val_data and (self.step + 1) % cfg.validation.every == 0:
                    with self.timer("validation"):
                        metrics.update(self.validate())
                metrics.update(self.timer.pop())
                self.writer.log(self.step, metrics)
                self.step += 1
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{metrics['ppo/kl']:.4f}")
                out_of_time = cfg.max_time is not None and time.monotonic() - start > cfg.max_time
                if self._agree(self.stop_requested or out_of_time):
                    if self.rank == 0:
                        log.warning(
                            "stopping at step %d (%s): checkpointing",
                            self.step,
                            "SIGTERM" if self.stop_requested else "max_time",
                        )
                    self.save()
                    last_saved = self.step
                    break
                if cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0:
                    self.save()
                    last_saved = self.step
            if cfg.checkpoint.save_at_end and last_saved != self.step and self.step >= cfg.ppo.num_steps:
                self.save()
        finally:
            if bar is not None:
                bar.close()
            self.writer.close()
        return self.writer.path if self.rank == 0 else None

    def train_step(self) -> dict:
        cfg = self.cfg
        with self.timer("step"):
            with self.timer("generate"):
                rollout = self.generate_rollouts()
            critic_future = self.request_values(rollout)
            with self.timer("logprobs"):
                logp_BS, ref_logp_BS = self.compute_logprobs(rollout)
            with self.timer("critic_wait"):
                values_BT, scores_B = self.receive_values(critic_future, rollout)
            with self.timer("advantages"):
                batch, metrics = self.compute_advantages(rollout, logp_BS, ref_logp_BS, values_BT, scores_B)
            train_future = self.request_critic_train(rollout, batch)
            if self.step >= cfg.ppo.critic_warmup_steps:
                with self.timer("train"):
                    metrics.update(self.update_policy(rollout, batch))
                with self.timer("refit"):
                    self.engine.refit(self.policy.module)
            with self.timer("critic_wait"):
                metrics.update(self.receive_critic_train(train_future))
            self.kl_ctl.update(metrics["ppo/kl"], cfg.ppo.rollout_batch_size)
            if cfg.logging.samples_every and self.step % cfg.logging.samples_every == 0:
                self.dump_samples(rollout, scores_B)
        return metrics

    # -- phases -------------------------------------------------------------------------------------------
    def _my_positions(self, n: int, groups: int, seed: int | None) -> list[int]:
        return minibatch_positions(n, groups, self.dp, self.dp_rank, seed)

    def _generate(self, prompts, positions, sampling_kw, step_seed) -> Rollout:
        """Generate for `prompts` in engine-sized chunks; returns the assembled rollout."""
        chunk = self.cfg.generation.max_batch_size
        parts = []
        for lo in range(0, len(prompts), chunk):
            sub = prompts[lo : lo + chunk]
            tokens_BP, lengths_B = pad_prompts(sub, self.tokenizer.pad_id)
            sampling = SamplingParams(
                **sampling_kw,
                eos_token_id=self.tokenizer.eos_id,
                pad_token_id=self.tokenizer.pad_id,
                seeds=sample_seeds(self.cfg.seed, step_seed, positions[lo : lo + chunk]),
            )
            out = self.engine.generate(tokens_BP.to(self.device), lengths_B.to(self.device), sampling)
            total = int((lengths_B.to(self.device) + out.response_lengths_B).max())
            part = assemble(
                tokens_BP.to(self.device),
                lengths_B.to(self.device),
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

    def generate_rollouts(self) -> Rollout:
        """Sample one response per prompt of this DP rank's share of the step's prompts (engine = last refit)."""
        global_indices = self.sampler.next_batch(self.cfg.ppo.rollout_batch_size)
        positions = self._my_positions(
            len(global_indices), self.cfg.ppo.num_mini_batches, self.cfg.seed * 7 + self.step
        )
        prompts = [self.train_data.items[global_indices[p]] for p in positions]
        return self._generate(prompts, positions, self._sampling_kw(), self.step)

    def _gather_dp(self, rollout: Rollout, *arrays):
        """The whole global batch on global rank 0, rows in global-position order (the order a single process would
        hold them in, so the critic sees the same batch for any DP size); a list of None elsewhere."""
        parts = [None] * self.dp
        dist.all_gather_object(parts, (rollout.positions, arrays), group=self.dp_group)
        if self.rank != 0:
            return [None] * len(arrays)
        order = np.argsort(np.concatenate([np.asarray(pos) for pos, _ in parts]), kind="stable")
        out = []
        for i, a in enumerate(arrays):
            if isinstance(a, list):
                flat = [x for _, arrs in parts for x in arrs[i]]
                out.append([flat[j] for j in order])
            else:
                out.append(np.concatenate([arrs[i] for _, arrs in parts])[order])
        return out

    def request_values(self, rollout: Rollout):
        """Send the whole batch to critic_infer from rank 0 (non-blocking); returns a future on rank 0."""
        tokens, lengths, prompt_lengths, labels = self._gather_dp(
            rollout,
            rollout.tokens_BT.cpu().numpy(),
            rollout.lengths_B.cpu().numpy(),
            rollout.prompt_lengths_B.cpu().numpy(),
            list(rollout.labels),
        )
        if self.rank != 0:
            return None
        return self.critic.infer_async(
            tokens, lengths, prompt_lengths, labels=labels if any(x is not None for x in labels) else None
        )

    def receive_values(self, future, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """This DP rank's values [B, T] and scores [B] from the critic's answer (broadcast from rank 0)."""
        B, T = rollout.tokens_BT.shape
        values = torch.zeros(B * self.dp, T, dtype=torch.float32)
        scores = torch.zeros(B * self.dp, dtype=torch.float32)
        if self.rank == 0:
            v, r = future.result()
            values.copy_(torch.as_tensor(np.asarray(v, dtype=np.float32)))
            scores.copy_(torch.as_tensor(np.asarray(r, dtype=np.float32)).reshape(-1))
        values, scores = values.to(self.device), scores.to(self.device)
        dist.broadcast(values, src=0)
        dist.broadcast(scores, src=0)
        mine = torch.tensor(rollout.positions, device=values.device)
        return values[mine], scores[mine]

    def _micro_batches(
        self, rollout: Rollout, rows: list[int] | None = None, size: int | None = None, **per_token
    ) -> list[dict]:
        rows = list(range(rollout.batch_size)) if rows is None else rows
        mbs = size or self.cfg.ppo.micro_batch_size
        out = []
        for lo in range(0, len(rows), mbs):
            idx = torch.tensor(rows[lo : lo + mbs], device=rollout.tokens_BT.device)
            mb = {"tokens": rollout.tokens_BT[idx], "mask": rollout.mask_BS[idx], "ended": rollout.ended_B[idx]}
            mb.update({k: v[idx] for k, v in per_token.items()})
            out.append(mb)
        return out

    def _logprobs_fn(self, batch, logits_BTV):
        return vocab_parallel_logprobs(
            logits_BTV[:, :-1],
            batch["tokens"][:, 1:],
            self.tp_group,
            temperature=self._temperature,
            vocab_size=self.cfg.model.vocab_size,
        )

    @property
    def _temperature(self) -> float:
        return 1.0 if self.cfg.sampling.greedy else self.cfg.sampling.temperature

    def compute_logprobs(self, rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, T-1] of the sampled tokens under the policy (training layout) and the reference."""
        micro = self._micro_batches(rollout, size=self.cfg.ppo.forward_micro_batch_size)
        logp = self.policy.forward(micro, self._logprobs_fn)
        ref_logp = self.reference.forward(self.policy, micro, self._logprobs_fn)
        if self.pp == 1:
            return torch.cat(logp), torch.cat(ref_logp)
        B, T = rollout.tokens_BT.shape
        both = torch.zeros(2, B, T - 1, dtype=torch.float32, device=self.device)
        if self.last_stage:
            both[0].copy_(torch.cat(logp))
            both[1].copy_(torch.cat(ref_logp))
        self._from_last_stage(both)
        return both[0], both[1]

    def _from_last_stage(self, t: torch.Tensor) -> None:
        """Overwrite `t` in place with the last pipeline stage's values (PP > 1 only)."""
        dist.broadcast(t, src=self.pp_last_rank, group=self.pp_group)

    def compute_advantages(self, rollout, logp_BS, ref_logp_BS, values_BT, scores_B) -> tuple[dict, dict]:
        cfg, mask = self.cfg.ppo, rollout.mask_BS
        values_BS = values_BT[:, :-1] * mask
        kl_BS = rl.kl_estimate(logp_BS, ref_logp_BS, cfg.kl.estimator, cfg.kl.use_absolute_kl)
        rewards_BS = rl.per_token_rewards(scores_B, kl_BS, mask, self.kl_ctl.value, cfg.score_clip)
        advantages_BS, returns_BS = rl.gae(values_BS, rewards_BS, mask, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            advantages_BS = rl.masked_whiten(advantages_BS, mask, group=self.dp_group)
        # Rollout statistics over the whole job (sums and counts all-reduced over DP).
        k1_BS = logp_BS - ref_logp_BS
        diff_BS = (rollout.engine_logp_BS - logp_BS).abs()
        ratio_err_BS = (torch.exp(logp_BS - rollout.engine_logp_BS) - 1).abs()
        sums = torch.stack(
            [
                (k1_BS * mask).sum(),
                (rl.kl_estimate(logp_BS, ref_logp_BS, "k3") * mask).sum(),
                mask.sum(),
                scores_B.sum(),
                (scores_B**2).sum(),
                torch.tensor(float(len(scores_B)), device=mask.device),
                rollout.response_lengths_B.float().sum(),
                rollout.ended_B.float().sum(),
                (diff_BS * mask).sum(),
                (ratio_err_BS * mask).sum(),
                (rewards_BS * mask).sum(),
                (values_BS * mask).sum(),
            ]
        ).double()
        dist.all_reduce(sums, group=self.dp_group)
        (kl, kl3, tokens, s, s2, n, resp_len, ended, diff, ratio_err, rew, val) = sums.tolist()
        mismatch_max = (diff_BS * mask).amax().reshape(1)
        dist.all_reduce(mismatch_max, op=dist.ReduceOp.MAX, group=self.dp_group)
        metrics = {
            "rollout/reward_mean": s / n,
            "rollout/reward_std": math.sqrt(max(0.0, s2 / n - (s / n) ** 2)),
            "rollout/response_length_mean": resp_len / n,
            "rollout/ended_fraction": ended / n,
            "rollout/tokens": tokens,
            "rollout/token_reward_mean": rew / tokens,
            "rollout/value_mean": val / tokens,
            "ppo/kl": kl / tokens,
            "ppo/kl_k3": kl3 / tokens,
            "ppo/kl_coef": self.kl_ctl.value,
            "ppo/logprob_mismatch": diff / tokens,
            "ppo/logprob_mismatch_max": float(mismatch_max),
            "ppo/ratio_error": ratio_err / tokens,
        }
        batch = {
            "old_logp": logp_BS.detach(),
            "advantages": advantages_BS.detach(),
            "returns": returns_BS.detach(),
            "values": values_BS.detach(),
        }
        return batch, metrics

    def request_critic_train(self, rollout: Rollout, batch: dict):
        """Send returns and old values to critic_train from rank 0 (non-blocking)."""

        def full_grid(x_BS):  # the critic's [B, T] grid: the shifted grid plus an empty last position
            return torch.nn.functional.pad(x_BS.float(), (0, 1)).cpu().numpy()

        gathered = self._gather_dp(
            rollout,
            rollout.tokens_BT.cpu().numpy(),
            rollout.lengths_B.cpu().numpy(),
            full_grid(batch["returns"]),
            full_grid(batch["values"]),
            full_grid(rollout.mask_BS),
        )
        if self.rank != 0:
            return None
        return self.critic.train_async(*gathered)

    def receive_critic_train(self, future) -> dict:
        names = ("loss", "explained_variance", "value_clipfrac", "grad_norm")
        out = torch.zeros(len(names), dtype=torch.float64)
        if self.rank == 0:
            result = future.result()
            out = torch.tensor([float(np.asarray(result[k]).reshape(-1)[0]) for k in names], dtype=torch.float64)
        out = out.to(self.device)
        dist.broadcast(out, src=0)
        vals = out.tolist()
        return {
            "critic/value_loss": vals[0],
            "critic/explained_var": vals[1],
            "critic/value_clipfrac": vals[2],
            "critic/grad_norm": vals[3],
        }

    def update_policy(self, rollout: Rollout, batch: dict) -> dict:
        """ppo.epochs passes of ppo.num_mini_batches optimizer steps over this step's rollouts."""
        cfg = self.cfg.ppo
        B = rollout.batch_size
        per_mini = B // cfg.num_mini_batches
        stats, grad_norms = [], []
        g = torch.Generator().manual_seed(self.cfg.seed * 31 + self.step)
        for epoch in range(cfg.epochs):
            # Epoch 0 keeps the global mini-batches laid out by _my_positions; later epochs reshuffle locally.
            order = list(range(B)) if epoch == 0 else torch.randperm(B, generator=g).tolist()
            for m in range(cfg.num_mini_batches):
                rows = order[m * per_mini : (m + 1) * per_mini]
                micro = self._micro_batches(rollout, rows, **batch)
                keep = [rl.policy_loss_mask(mb["mask"], mb["ended"], cfg.zero_unended) for mb in micro]
                num_tokens = max(1, rl.global_token_count(keep, group=self.dp_group))

                def loss_fn(mb, logits_BTV, num_tokens=num_tokens):
                    logp, entropy = vocab_parallel_logprobs(
                        logits_BTV[:, :-1],
                        mb["tokens"][:, 1:],
                        self.tp_group,
                        temperature=self._temperature,
                        vocab_size=self.cfg.model.vocab_size,
                        with_entropy=True,
                    )
                    loss, st = rl.policy_loss(
                        logp,
                        mb["old_logp"],
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
                    )
                    stats.append(st)
                    return loss, {}

                grad_norms.append(self.policy.step(micro, loss_fn)["grad_norm"])
        keys = ("pg_loss", "clipfrac", "entropy", "approx_kl", "ratio", "ratio_max")
        reduced = rl.reduce_stats(stats, group=self.dp_group)  # loss statistics: last pipeline stage only
        if self.pp > 1:
            vals = torch.tensor(
                [reduced[k] if self.last_stage else 0.0 for k in keys], dtype=torch.float64, device=self.device
            )
            self._from_last_stage(vals)
            reduced = dict(zip(keys, vals.tolist(), strict=True))
        return {
            "ppo/policy_loss": reduced["pg_loss"],
            "ppo/clipfrac": reduced["clipfrac"],
            "ppo/entropy": reduced["entropy"],
            "ppo/approx_kl": reduced["approx_kl"],
            "ppo/ratio_mean": reduced["ratio"],
            "ppo/ratio_max": reduced["ratio_max"],
            "ppo/grad_norm": float(np.mean(grad_norms)),
            "ppo/lr": self.policy.optimizer.param_groups[0]["lr"],
        }

    def dump_samples(self, rollout: Rollout, scores_B: torch.Tensor) -> None:
        if self.rank != 0:
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
        """Generate for the held-out prompts (greedy or sampled) and score them with the critic job's reward."""
        items = self.val_data.items[: self.cfg.validation.max_prompts]
        n = (len(items) // self.dp) * self.dp
        if n == 0:
            return {}
        positions = self._my_positions(n, 1, None)
        sampling = self._sampling_kw(self.cfg.validation.greedy)
        rollout = self._generate([items[i] for i in positions], positions, sampling, 10_000_000 + self.step)
        _, scores = self.receive_values(self.request_values(rollout), rollout)
        sums = torch.stack(
            [
                scores.sum(),
                rollout.response_lengths_B.float().sum().to(scores.device),
                rollout.ended_B.float().sum().to(scores.device),
            ]
        ).double()
        dist.all_reduce(sums, group=self.dp_group)
        s, length, ended = sums.tolist()
        return {"val/reward_mean": s / n, "val/response_length_mean": length / n, "val/ended_fraction": ended / n}

    # -- checkpoints and signals ----------------------------------------------------------------------------
    def trainer_state(self) -> dict:
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "kl_controller": self.kl_ctl.state_dict(),
            "optimizer_steps": self.policy.steps_taken,
        }

    def save(self) -> None:
        cfg = self.cfg.checkpoint
        critic_future = None
        if self.rank == 0 and cfg.save_critic:
            critic_future = self.critic.save_async(self.step)
        path = dist_ckpt.save(
            self.cfg.checkpoint_dir,
            self.step,
            [self.policy.module],
            self.policy.optimizer,
            self.trainer_state(),
            keep=cfg.keep,
            model_cfg=self.cfg.model,
        )
        if critic_future is not None:
            critic_future.result()
        if self.rank == 0:
            log.info("checkpoint written: %s", path)

    def _resume(self) -> None:
        if not self.cfg.checkpoint.resume:
            return
        path = dist_ckpt.latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            return
        state = dist_ckpt.load(path, [self.policy.module], self.policy.optimizer)
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctl.load_state_dict(state["kl_controller"])
        self.policy.steps_taken = int(state.get("optimizer_steps", 0))
        self.engine.refit(self.policy.module)
        if self.rank == 0:
            log.warning("resumed from %s at step %d", path, self.step)

    def _install_signal_handlers(self) -> None:
        def request_stop(signum, frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGUSR1, request_stop)

    def _agree(self, flag: bool) -> bool:
        """True on every rank if any rank's flag is set (so all ranks stop at the same step)."""
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())
