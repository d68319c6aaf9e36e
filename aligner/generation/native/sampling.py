"""Token selection for one decode step: pure tensor functions, CUDA-graph safe (no host syncs, static shapes).

Input: full-vocabulary logits `logits_BV` in float32 (the engine gathers the TP slices and drops megatron's vocabulary
padding first, so padding columns can never be drawn).
- `token_logprobs`: log_softmax(logits / temperature) at the chosen tokens — the full distribution, exactly what
  training recomputes (`aligner.models.logprobs`). Top-k, top-p and banned tokens do not renormalise it.
- `sample_tokens`: greedy argmax, or inverse-CDF sampling from softmax(logits / temperature) restricted to the top-k
  and then the top-p nucleus, with `banned_BV` (EOS/stop tokens before min_new_tokens) removed, from one uniform
  number per sample `u_B` in [0, 1).
- `select_tokens` (what a decode step runs): greedy by argmax; plain sampling (no top-k, no top-p) as a
  Gumbel race, argmax(logits / T + g) with standard Gumbel noise g per sample, step and token — an exact draw from
  softmax(logits / T) — where g comes from a counter-based hash of (the sample's key, the step, the token)
  (`gumbel_noise`): computed inside the fused kernels, no random numbers stored, no sort or scan over the vocabulary;
  top-k / top-p by inverse CDF from the step's uniform. Either way the draws of a sample are a function of its own
  seed alone (its key, or its uniforms from a generator seeded by it), independent of the batch it is in.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("aligner::cumsum_rows", mutates_args=())
def cumsum_rows(x: torch.Tensor) -> torch.Tensor:
    """Cumulative sum along the last dimension, as an opaque op: torch.compile calls PyTorch's own kernel here instead
    of generating one (inductor's split scan fails to compile some [B, V] shapes, e.g. [64, 32000] on an H200)."""
    return x.cumsum(-1)


@cumsum_rows.register_fake
def _(x):
    return torch.empty_like(x)


def _scaled(logits_BV, temperature):
    """float32 logits / temperature; the Python float 1.0 skips a pass over [B, V] (callers that scaled once)."""
    logits = logits_BV.float()
    return logits if isinstance(temperature, float) and temperature == 1.0 else logits / temperature


def token_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """log softmax(logits / temperature)[token] per row, float32 [B]."""
    scaled = _scaled(logits_BV, temperature)
    picked = scaled.gather(-1, tokens_B.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def sample_tokens(
    logits_BV: torch.Tensor,
    u_B: torch.Tensor | None,
    *,
    greedy: bool,
    temperature,
    top_k: int = 0,
    top_p: torch.Tensor | float | None = None,
    banned_BV: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row, int64 [B]. `top_k`/`greedy` are Python values (they change the kernels); `temperature` and
    `top_p` may be 0-d tensors (CUDA-graph inputs). `top_p=None` skips the nucleus step entirely."""
    scaled = _scaled(logits_BV, temperature)
    if banned_BV is not None:
        scaled = scaled.masked_fill(banned_BV, float("-inf"))
    if greedy:
        return scaled.argmax(dim=-1)
    index_BK = None
    if top_k and top_k < scaled.shape[-1]:
        scaled, index_BK = scaled.topk(top_k, dim=-1)  # sorted, descending
    elif top_p is not None:
        scaled, index_BK = scaled.sort(dim=-1, descending=True)
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None:
        # Keep a token while the mass of the tokens before it is below top_p: the most likely always stays.
        probs = probs * ((cumsum_rows(probs) - probs) < top_p)
    cdf = cumsum_rows(probs)
    # u * total mass, strictly below the last cdf value, so the pick is a token with nonzero probability.
    target = u_B.unsqueeze(-1).to(cdf.dtype) * cdf[:, -1:]
    pick = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
    return pick if index_BK is None else index_BK.gather(-1, pick.unsqueeze(-1)).squeeze(-1)


_M32 = 0xFFFF_FFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2**32 for int64 h in [0, 2**32) and a constant c < 2**32, without overflowing int64."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finalizer on int64 values in [0, 2**32): a bijection whose every output bit depends on
    every input bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EB_CA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2_AE35)
    return h ^ (h >> 16)


def keys_for_seeds(seeds: list[int]) -> torch.Tensor:
    """int64 [B] keys in [0, 2**32) for gumbel_noise, one per seed (all 64 bits of it count)."""
    lo = torch.tensor([int(s) & _M32 for s in seeds], dtype=torch.int64)
    hi = torch.tensor([(int(s) >> 32) & _M32 for s in seeds], dtype=torch.int64)
    return _mix32(lo ^ _mix32(hi ^ 0x2545_F491))


def gumbel_noise(key_B: torch.Tensor, step_t: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [B, vocab] float32, a function of (key_B[b], step, token) alone: a 32-bit hash of the
    three gives a uniform w = (h + 1/2) / 2**32, and g = -log(-log1p(-w)) keeps the relative precision of the small
    exponentials that decide the race (its upper tail is cut at 22.9, where a token's noise lies with probability
    2**-32; w is kept below 1 - 2**-24, which moves the lowest noise values of a token with that probability)."""
    row = _mix32(key_B ^ _mul32(step_t + 1, 0x9E37_79B9))  # [B]: this sample's stream at this step
    token = _mul32(torch.arange(1, vocab + 1, device=key_B.device), 0x27D4_EB2F)
    h = _mix32(row[:, None] ^ token)  # [B, V]
    w = ((h.float() + 0.5) * 2.0**-32).clamp(max=1.0 - 2.0**-24)
    return -torch.log(-torch.log1p(-w))


def select_tokens(
    logits_BV: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    u_BR: torch.Tensor,
    key_B: torch.Tensor,
    step_t: torch.Tensor,
    min_new_t: torch.Tensor,
    top_p: torch.Tensor,
    end_mask_V: torch.Tensor,
    ended_B: torch.Tensor,
    pad_t: torch.Tensor,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decode step's choice for every sample, as the engine records it: a pure function of the step state, so
    that `torch.compile` can fuse its passes over [B, V] into a few kernels (the engine does, with compiled kernels).

    logits_BV: the full (gathered) logits, megatron's vocabulary padding included (dropped here); u_BR: each sample's
    uniforms, column `step_t` is this step's (top-k / top-p); key_B: each sample's key (keys_for_seeds: plain
    sampling's Gumbel noise); end tokens are banned while step_t < min_new_t. Returns (tokens,
    log-probs, active, ended): samples that had already ended get `pad_t` and log-prob 0 (active False), and ended
    is updated with the end tokens drawn now."""
    scaled_BV = logits_BV[:, :vocab_size].float() / temperature  # scaled once, used twice
    banned_V = end_mask_V & (step_t < min_new_t)
    if greedy or not (top_k or use_top_p):
        race_BV = scaled_BV.masked_fill(banned_V, float("-inf"))
        if not greedy:  # a Gumbel race: an exact draw from softmax(scaled) without the banned tokens
            race_BV = race_BV + gumbel_noise(key_B, step_t, vocab_size)
        tok_B = race_BV.argmax(dim=-1)
    else:
        u_B = u_BR.gather(1, step_t.expand(u_BR.shape[0]).unsqueeze(1)).squeeze(1)
        tok_B = sample_tokens(
            scaled_BV,
            u_B,
            greedy=False,
            temperature=1.0,
            top_k=top_k,
            top_p=top_p if use_top_p else None,
            banned_BV=banned_V,
        )
    logp_B = token_logprobs(scaled_BV, tok_B, 1.0)
    active_B = ~ended_B
    tok_B = torch.where(active_B, tok_B, pad_t)
    logp_B = torch.where(active_B, logp_B, 0.0)
    return tok_B, logp_B, active_B, ended_B | (active_B & end_mask_V[tok_B])


def uniforms_for_seeds(seeds: list[int], steps: int) -> torch.Tensor:
    """[B, steps] float32 uniforms in [0, 1); row b depends only on seeds[b] (its own CPU generator)."""
    rows = []
    for seed in seeds:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        rows.append(torch.rand(steps, generator=gen, dtype=torch.float32))
    return torch.stack(rows) if rows else torch.empty(0, steps)


def choose_and_record(
    logits_BV: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    u_BR: torch.Tensor,
    key_B: torch.Tensor,
    step_t: torch.Tensor,
    min_new_t: torch.Tensor,
    top_p: torch.Tensor,
    end_mask_V: torch.Tensor,
    ended_B: torch.Tensor,
    pad_t: torch.Tensor,
    out_tokens_BR: torch.Tensor,
    out_logp_BR: torch.Tensor,
    lengths_B: torch.Tensor,
    cur_tok_B: torch.Tensor,
    pos_B: torch.Tensor,
    *,
    greedy: bool,
    top_k: int,
    use_top_p: bool,
) -> None:
    """select_tokens, and the step recorded in the engine's state in place: token and log-prob into column step_t
    of out_tokens_BR / out_logp_BR, lengths_B counts active samples, ended_B, the next input token cur_tok_B, and
    pos_B and step_t advanced by one. One function, so that torch.compile fuses the bookkeeping into the token
    choice's kernels (eight small kernels of a decode step otherwise)."""
    tok_B, logp_B, active_B, ended_now_B = select_tokens(
        logits_BV, vocab_size, temperature, u_BR, key_B, step_t, min_new_t, top_p, end_mask_V, ended_B, pad_t,
        greedy=greedy, top_k=top_k, use_top_p=use_top_p,
    )  # fmt: skip
    step_B1 = step_t.expand(tok_B.shape[0]).unsqueeze(1)
    out_tokens_BR.scatter_(1, step_B1, tok_B.unsqueeze(1))
    out_logp_BR.scatter_(1, step_B1, logp_B.unsqueeze(1))
    lengths_B += active_B
    ended_B.copy_(ended_now_B)
    cur_tok_B.copy_(tok_B)
    pos_B += 1
    step_t += 1
