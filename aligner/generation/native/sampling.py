"""Token selection for one decode step: pure tensor functions, CUDA-graph safe (no host syncs, static shapes).

Input: full-vocabulary logits `logits_BV` in float32 (the engine gathers the TP slices and drops megatron's vocabulary
padding first, so padding columns can never be drawn), one uniform number per sample `u_B` in [0, 1).
- `token_logprobs`: log_softmax(logits / temperature) at the chosen tokens — the full distribution, exactly what
  training recomputes (`aligner.models.logprobs`). Top-k, top-p and banned tokens do not renormalise it.
- `sample_tokens`: greedy argmax, or inverse-CDF sampling from softmax(logits / temperature) restricted to the top-k
  and then the top-p nucleus, with `banned_BV` (EOS/stop tokens before min_new_tokens) removed. Inverse-CDF needs
  one uniform per sample and step (a Gumbel race would need B x V random numbers per step), so the draws of a sample
  are a function of its own seed alone: the engine draws each sample's uniforms from a generator seeded by that
  sample's seed, independent of the batch it is in.
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


def select_tokens(
    logits_BV: torch.Tensor,
    vocab_size: int,
    temperature: torch.Tensor,
    u_BR: torch.Tensor,
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
    uniforms, column `step_t` is this step's; end tokens are banned while step_t < min_new_t. Returns (tokens,
    log-probs, active, ended): samples that had already ended get `pad_t` and log-prob 0 (active False), and ended
    is updated with the end tokens drawn now."""
    scaled_BV = logits_BV[:, :vocab_size].float() / temperature  # scaled once, used twice
    banned_V = end_mask_V & (step_t < min_new_t)
    u_B = None if greedy else u_BR.gather(1, step_t.expand(u_BR.shape[0]).unsqueeze(1)).squeeze(1)
    tok_B = sample_tokens(
        scaled_BV,
        u_B,
        greedy=greedy,
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
