"""The plain single-process baseline: one PPO step with HF transformers models, all four resident on one device.

Policy and frozen reference: LlamaForCausalLM; critic and reward model: LlamaModel + Linear(hidden, 1) (one value per
position; the reward is the value at the last token). All in `workload.dtype` (bf16 on GPU) with SDPA attention,
random weights, trained in that dtype with torch AdamW (fused on GPU): the plain loop, no fp32 master copy.

One step, each phase timed with a device sync on both sides (`timing` keys as in aligner's actor where they mean the
same): generate (HF `generate`, sampling at temperature 1 over the full vocabulary, static cache, compiled by
transformers on GPU, `gen_batch` prompts per call, no EOS so every response is full length) -> logprobs (policy and
reference, micro-batches) -> values_rewards (critic and reward model, micro-batches) -> advantages (aligner.rl: k1
KL penalty, GAE, whitening) -> train (clipped PPO loss, `num_mini_batches` optimizer steps per epoch) ->
critic_train (clipped value loss, the same optimizer-step layout). Hyper-parameters are conf/ppo_actor.yaml's and
conf/ppo_critic.yaml's; they do not change the work.
Imports torch, transformers and aligner.rl only (no megatron, omegaconf or PyTriton: runs under numpy 2).
"""

from __future__ import annotations

import copy
import logging
import time

import torch

from aligner import rl
from aligner.utils.metrics import Timer
from benchmarks.ppo_step.workload import DeviceMemoryPoller, Workload, result

log = logging.getLogger(__name__)

BOS, EOS, PAD = 1, 2, 0
KL_COEF, GAMMA, LAM, CLIP_EPS, VALUE_CLIP_EPS = 0.02, 1.0, 0.95, 0.2, 0.2
POLICY_OPTIM = dict(lr=1e-6, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8)
CRITIC_OPTIM = dict(lr=9e-6, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
CLIP_GRAD = 1.0


class ValueModel(torch.nn.Module):
    """LlamaModel + a scalar head: [B, T] token ids -> [B, T] float32 values."""

    def __init__(self, config):
        super().__init__()
        from transformers import LlamaModel

        self.model = LlamaModel(config)
        self.head = torch.nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        hidden_BTH = self.model(input_ids=tokens_BT, use_cache=False).last_hidden_state
        return self.head(hidden_BTH).squeeze(-1).float()


def llama_config(w: Workload):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=w.vocab_size,
        hidden_size=w.hidden_size,
        intermediate_size=w.ffn_hidden_size,
        num_hidden_layers=w.num_layers,
        num_attention_heads=w.num_attention_heads,
        num_key_value_heads=w.num_query_groups,
        max_position_embeddings=max(w.seq_len, 64),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        attn_implementation="sdpa",
    )


def token_logprobs(logits_BTV: torch.Tensor, tokens_BT: torch.Tensor) -> torch.Tensor:
    """log p(tokens[:, t+1] | tokens[:, :t+1]) on the shifted grid [B, T-1], in float32."""
    logp_BSV = torch.log_softmax(logits_BTV[:, :-1].float(), dim=-1)
    return logp_BSV.gather(-1, tokens_BT[:, 1:].unsqueeze(-1)).squeeze(-1)


class HFLoop:
    def __init__(self, w: Workload, device: torch.device, compile_generate: bool, seed: int = 0):
        from transformers import LlamaForCausalLM

        w.validate()
        self.w, self.device, self.compile_generate = w, device, compile_generate
        self.dtype = getattr(torch, w.dtype)
        self.timer = Timer(torch.cuda.synchronize if device.type == "cuda" else None)
        torch.manual_seed(seed)
        cfg = llama_config(w)
        with torch.device(device):
            self.policy = LlamaForCausalLM(cfg).to(self.dtype)
            self.critic = ValueModel(cfg).to(self.dtype)
            self.reward_model = ValueModel(cfg).to(self.dtype).eval().requires_grad_(False)
        self.reference = copy.deepcopy(self.policy).eval().requires_grad_(False)
        fused = device.type == "cuda"
        self.policy_opt = torch.optim.AdamW(self.policy.parameters(), fused=fused, **POLICY_OPTIM)
        self.critic_opt = torch.optim.AdamW(self.critic.parameters(), fused=fused, **CRITIC_OPTIM)
        self.prompt_rng = torch.Generator().manual_seed(seed + 1)
        # Response tokens on the shifted grid: positions prompt_len-1 .. seq_len-2 (every sequence is full length).
        self.mask_BS = torch.zeros(w.rollouts, w.seq_len - 1, device=device)
        self.mask_BS[:, w.prompt_len - 1 :] = 1.0

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> dict:
        with self.timer("step"):
            with self.timer("generate"):
                tokens_BT = self.generate(self.prompts())
            with self.timer("logprobs"):
                logp_BS, ref_logp_BS = self.logprobs(tokens_BT)
            with self.timer("values_rewards"):
                values_BT, scores_B = self.values_and_rewards(tokens_BT)
            with self.timer("advantages"):
                batch = self.advantages(logp_BS, ref_logp_BS, values_BT, scores_B)
            self.last_kl = ((logp_BS - ref_logp_BS) * self.mask_BS).sum() / self.mask_BS.sum()  # read after timing
            with self.timer("train"):
                self.update_policy(tokens_BT, batch)
            with self.timer("critic_train"):
                self.update_critic(tokens_BT, batch)
        return {k.removeprefix("timing/"): v for k, v in self.timer.pop().items()}

    # -- phases ---------------------------------------------------------------------------------------------
    def prompts(self) -> torch.Tensor:
        """[rollouts, prompt_len] ids: BOS then random ordinary tokens (never PAD/BOS/EOS)."""
        w = self.w
        body = torch.randint(3, w.vocab_size, (w.rollouts, w.prompt_len - 1), generator=self.prompt_rng)
        return torch.cat([torch.full((w.rollouts, 1), BOS), body], 1).to(self.device)

    @torch.no_grad()
    def generate(self, prompts_BP: torch.Tensor) -> torch.Tensor:
        """Prompts + sampled responses [rollouts, seq_len], `gen_batch` rows per HF generate call."""
        w = self.w
        self.policy.eval()
        kwargs = dict(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=w.response_len,
            eos_token_id=None,
            pad_token_id=PAD,
            cache_implementation="static",
        )
        if not self.compile_generate:
            kwargs["disable_compile"] = True
        parts = []
        for lo in range(0, w.rollouts, w.gen_batch):
            chunk = prompts_BP[lo : lo + w.gen_batch]
            out = self.policy.generate(chunk, attention_mask=torch.ones_like(chunk), **kwargs)
            if out.shape[1] != w.seq_len:
                raise RuntimeError(
                    f"HF generate returned {out.shape[1] - w.prompt_len} new tokens, expected "
                    f"{w.response_len}: EOS must be ignored"
                )
            parts.append(out)
        return torch.cat(parts)

    def _micro(self, n: int):
        return range(0, n, self.w.micro_batch)

    @torch.no_grad()
    def logprobs(self, tokens_BT):
        self.policy.eval()
        logp, ref = [], []
        for lo in self._micro(tokens_BT.shape[0]):
            mb = tokens_BT[lo : lo + self.w.micro_batch]
            logp.append(token_logprobs(self.policy(input_ids=mb, use_cache=False).logits, mb))
            ref.append(token_logprobs(self.reference(input_ids=mb, use_cache=False).logits, mb))
        return torch.cat(logp), torch.cat(ref)

    @torch.no_grad()
    def values_and_rewards(self, tokens_BT):
        self.critic.eval()
        values, scores = [], []
        for lo in self._micro(tokens_BT.shape[0]):
            mb = tokens_BT[lo : lo + self.w.micro_batch]
            values.append(self.critic(mb))
            scores.append(self.reward_model(mb)[:, -1])  # every sequence ends at the last position
        return torch.cat(values), torch.cat(scores)

    def advantages(self, logp_BS, ref_logp_BS, values_BT, scores_B) -> dict:
        mask = self.mask_BS
        values_BS = values_BT[:, :-1] * mask
        kl_BS = rl.kl_estimate(logp_BS, ref_logp_BS, "k1")
        rewards_BS = rl.per_token_rewards(scores_B, kl_BS, mask, KL_COEF)
        advantages_BS, returns_BS = rl.gae(values_BS, rewards_BS, mask, GAMMA, LAM)
        return {
            "old_logp": logp_BS,
            "advantages": rl.masked_whiten(advantages_BS, mask),
            "returns": returns_BS,
            "values": values_BS,
        }

    def _minibatches(self, seed: int):
        """Row indices of each mini-batch, `epochs` shuffled passes."""
        w = self.w
        g = torch.Generator().manual_seed(seed)
        per = w.rollouts // w.num_mini_batches
        for _ in range(w.epochs):
            order = torch.randperm(w.rollouts, generator=g).to(self.device)
            for m in range(w.num_mini_batches):
                yield order[m * per : (m + 1) * per]

    def update_policy(self, tokens_BT, batch) -> None:
        self.policy.train()
        for rows in self._minibatches(seed=1):
            self.policy_opt.zero_grad(set_to_none=True)
            num_tokens = rl.global_token_count(self.mask_BS[rows])
            for lo in self._micro(len(rows)):
                idx = rows[lo : lo + self.w.micro_batch]
                mb = tokens_BT[idx]
                logits_BTV = self.policy(input_ids=mb, use_cache=False).logits
                with torch.no_grad():  # a statistic, as in aligner's loss (entropy_coef = 0)
                    entropy_BS = rl.entropy_from_logits(logits_BTV[:, :-1])
                loss, _ = rl.policy_loss(
                    token_logprobs(logits_BTV, mb),
                    batch["old_logp"][idx],
                    batch["advantages"][idx],
                    self.mask_BS[idx],
                    num_tokens,
                    clip_eps=CLIP_EPS,
                    entropy_BT=entropy_BS,
                )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), CLIP_GRAD)
            self.policy_opt.step()

    def update_critic(self, tokens_BT, batch) -> None:
        self.critic.train()
        returns_BT = torch.nn.functional.pad(batch["returns"], (0, 1))  # the critic's [B, T] grid
        old_values_BT = torch.nn.functional.pad(batch["values"], (0, 1))
        mask_BT = torch.nn.functional.pad(self.mask_BS, (0, 1))
        for rows in self._minibatches(seed=2):
            self.critic_opt.zero_grad(set_to_none=True)
            num_tokens = rl.global_token_count(mask_BT[rows])
            for lo in self._micro(len(rows)):
                idx = rows[lo : lo + self.w.micro_batch]
                loss, _ = rl.value_loss(
                    self.critic(tokens_BT[idx]),
                    old_values_BT[idx],
                    returns_BT[idx],
                    mask_BT[idx],
                    num_tokens,
                    clip_eps=VALUE_CLIP_EPS,
                )
                loss.backward()
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), CLIP_GRAD)
            self.critic_opt.step()


def run(w: Workload, steps: int, warmup: int, device: str | None = None, compile_generate: bool | None = None) -> dict:
    """Build the four models, run `steps` steps (the first `warmup` untimed in the means); the result record."""
    import transformers

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    compile_generate = dev.type == "cuda" if compile_generate is None else compile_generate
    poller = DeviceMemoryPoller().start() if dev.type == "cuda" else None
    t0 = time.perf_counter()
    loop = HFLoop(w, dev, compile_generate)
    setup_s = time.perf_counter() - t0
    timings, kl = [], []
    try:
        for i in range(steps):
            timings.append(loop.step())
            kl.append(float(loop.last_kl))
            log.warning(
                "hf step %d/%d: %.2f s (%s)",
                i + 1,
                steps,
                timings[-1]["step"],
                ", ".join(f"{k} {v:.2f}" for k, v in timings[-1].items() if k != "step"),
            )
    finally:
        if poller is not None:
            poller.stop()
    memory = {}
    if dev.type == "cuda":
        memory = {
            "torch_peak_allocated_gb": torch.cuda.max_memory_allocated(dev) / 1e9,
            "torch_peak_reserved_gb": torch.cuda.max_memory_reserved(dev) / 1e9,
            "gpu_mem_peak_gb": poller.peak_gb(),
        }
    return result(
        "hf",
        w,
        timings,
        warmup,
        gpus=1 if dev.type == "cuda" else 0,
        setup_s=setup_s,
        memory=memory,
        checks={"kl_step0": kl[0]},
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        versions={"torch": torch.__version__, "transformers": transformers.__version__},
        settings={
            "generate": "HF generate, static cache" + (", compiled" if compile_generate else ""),
            "attention": "sdpa",
            "optimizer": "torch AdamW" + (" (fused)" if dev.type == "cuda" else ""),
        },
    )
