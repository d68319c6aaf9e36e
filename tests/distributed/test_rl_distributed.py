"""DP parity of the RL maths: 2 gloo ranks holding uneven shares of a batch must reproduce the full-batch values.

Rank 0 holds 3 samples in micro-batches of 1 and 2, rank 1 holds 5 samples in micro-batches of 2, 1 and 2, and
the samples have different response lengths, so token counts differ per rank and per micro-batch.
"""

import torch
import torch.distributed as dist
from dist import run_ranks

from aligner.rl import (
    entropy_from_logits,
    explained_variance,
    gae,
    global_token_count,
    kl_estimate,
    masked_global_mean_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    policy_loss_mask,
    reduce_stats,
    value_loss,
)

B, T, H, V = 8, 9, 5, 6
RANK_ROWS = [(0, 3), (3, 8)]
RANK_MICRO_BATCHES = [[(0, 1), (1, 3)], [(3, 5), (5, 6), (6, 8)]]
# (prompt length, response length); responses reaching T were cut at the length limit (not ended).
LAYOUT = [(2, 3), (1, 8), (3, 5), (3, 1), (2, 7), (5, 2), (1, 4), (2, 6)]


def _logprobs(feats_BTH, W_HV, tokens_BT):
    logits_BTV = feats_BTH @ W_HV
    return torch.log_softmax(logits_BTV, -1).gather(-1, tokens_BT.unsqueeze(-1)).squeeze(-1), logits_BTV


def make_batch():
    g = torch.Generator().manual_seed(1234)
    f64 = dict(generator=g, dtype=torch.float64)
    feats = torch.randn(B, T, H, **f64)
    tokens = torch.randint(V, (B, T), generator=g)
    W0 = 0.5 * torch.randn(H, V, **f64)
    old_logp, _ = _logprobs(feats, W0 + 0.05 * torch.randn(H, V, **f64), tokens)
    ref_logp, _ = _logprobs(feats, W0 + 0.2 * torch.randn(H, V, **f64), tokens)
    mask = torch.zeros(B, T)
    for b, (p, n) in enumerate(LAYOUT):
        mask[b, p : p + n] = 1
    ended = torch.tensor([p + n < T for p, n in LAYOUT])
    scores = torch.randn(B, **f64)
    old_values = torch.randn(B, T, **f64)
    rewards = per_token_rewards(scores, kl_estimate(old_logp, ref_logp, "k3"), mask, kl_coef=0.1)
    return dict(
        feats=feats,
        tokens=tokens,
        W0=W0,
        old_logp=old_logp,
        mask=mask,
        ended=ended,
        old_values=old_values,
        rewards=rewards,
    )


def compute(rows, micro_batches, group):
    """The PPO maths of one step over the samples rows[0]:rows[1], reduced over `group`."""
    d = make_batch()
    lo, hi = rows
    mask, old_values = d["mask"][lo:hi], d["old_values"][lo:hi]
    adv, returns = gae(old_values, d["rewards"][lo:hi], mask, gamma=0.99, lam=0.95)
    mean, var = masked_global_mean_var(adv, mask, group)
    adv_w = masked_whiten(adv, mask, group)

    W = d["W0"].clone().requires_grad_(True)
    bias = torch.zeros((), dtype=torch.float64, requires_grad=True)  # a shared "critic" parameter
    pmasks = [policy_loss_mask(d["mask"][a:b], d["ended"][a:b], zero_unended=True) for a, b in micro_batches]
    n_policy = global_token_count(pmasks, group)
    n_value = global_token_count([d["mask"][a:b] for a, b in micro_batches], group)
    pol_total = torch.zeros((), dtype=torch.float64)
    val_total = torch.zeros((), dtype=torch.float64)
    pol_stats, val_stats = [], []
    for a, b in micro_batches:
        logp, logits = _logprobs(d["feats"][a:b], W, d["tokens"][a:b])
        loss, st = policy_loss(
            logp,
            d["old_logp"][a:b],
            adv_w[a - lo : b - lo],
            d["mask"][a:b],
            n_policy,
            dual_clip=3.0,
            entropy_BT=entropy_from_logits(logits),
            entropy_coef=0.01,
            ended_B=d["ended"][a:b],
            zero_unended=True,
        )
        loss.backward()
        pol_total += loss.detach()
        pol_stats.append(st)
        new_values = d["old_values"][a:b] + 0.3 + bias
        vloss, vst = value_loss(
            new_values, d["old_values"][a:b], returns[a - lo : b - lo], d["mask"][a:b], n_value, clip_eps=0.2
        )
        vloss.backward()
        val_total += vloss.detach()
        val_stats.append(vst)
    grads = torch.cat([W.grad.reshape(-1), bias.grad.reshape(1), pol_total.reshape(1), val_total.reshape(1)])
    if group is not None:
        dist.all_reduce(grads, group=group)  # what DDP's gradient sum does
    explained_var = explained_variance(old_values, returns, mask, group).item()
    return dict(
        mean=mean.item(),
        var=var.item(),
        adv_w=adv_w,
        returns=returns,
        n_policy=n_policy,
        n_value=n_value,
        W_grad=grads[:-3].reshape(H, V),
        bias_grad=grads[-3].item(),
        policy_loss=grads[-2].item(),
        value_loss=grads[-1].item(),
        policy_stats=reduce_stats(pol_stats, group),
        value_stats=reduce_stats(val_stats, group),
        explained_var=explained_var,
    )


def _rank_fn(rank, world_size):
    torch.manual_seed(rank)  # nothing may depend on the process RNG
    return compute(RANK_ROWS[rank], RANK_MICRO_BATCHES[rank], dist.group.WORLD)


def test_two_ranks_uneven_match_full_batch():
    full = compute((0, B), [(0, 2), (2, 8)], None)
    ranks = run_ranks(_rank_fn, 2)
    mask = make_batch()["mask"]
    assert [int(mask[a:b].sum()) for a, b in RANK_ROWS] == [16, 20]  # uneven token counts per rank
    assert full["n_policy"] == 21 and full["n_value"] == 36  # 2 unended samples, 8 + 7 tokens

    def close(a, b):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-10, atol=1e-12)

    for r, out in enumerate(ranks):
        lo, hi = RANK_ROWS[r]
        for key in ("mean", "var", "n_policy", "n_value", "policy_loss", "value_loss", "bias_grad", "explained_var"):
            close(out[key], full[key])
        close(out["W_grad"], full["W_grad"])
        close(out["adv_w"], full["adv_w"][lo:hi])
        close(out["returns"], full["returns"][lo:hi])
        for key in ("policy_stats", "value_stats"):
            assert out[key].keys() == full[key].keys()
            for name, value in full[key].items():
                close(out[key][name], value)
    assert full["W_grad"].abs().sum() > 0 and full["bias_grad"] != 0
    assert 0 < full["policy_stats"]["clipfrac"] < 1
