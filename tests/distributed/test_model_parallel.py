"""TP=2, PP=2 and DP=2 against one process, on the same full weights, through the real megatron-core on gloo."""

import functools

import pytest
import torch
from dist import run_ranks

CFG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=100,
    ffn_hidden_size=96,
    make_vocab_size_divisible_by=16,
)
BATCH, SEQ = 4, 9


def _model_cfg(arch):
    from aligner.config import ModelConfig

    extra = {} if arch == "llama" else {"arch": "gpt2", "num_query_groups": None}
    return ModelConfig(**{**CFG, **extra})


def _full_weights(rank, world, arch):
    from aligner.models.gpt import build_gpt
    from aligner.models.sharding import full_state_dict
    from aligner.parallel import initialize

    initialize(seed=3)
    cfg = _model_cfg(arch)
    return full_state_dict(build_gpt(cfg), cfg)


def _run(rank, world, tp, pp, arch, full, overlap=False, steps=1, uneven=False):
    from megatron.core import parallel_state as ps

    from aligner.config import OptimConfig
    from aligner.models.logprobs import default_tp_group, vocab_parallel_logprobs
    from aligner.models.sharding import full_state_dict, load_full_state_dict
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(tensor_parallel=tp, pipeline_parallel=pp, seed=3)
    cfg = _model_cfg(arch)
    # overlap: buckets of 2000 elements, so that several reductions start during the backward
    optim = OptimConfig(lr=1e-3, clip_grad=0.0, overlap_grad_reduce=overlap, grad_bucket_size=2000)
    model = TrainableModel(cfg, optim)
    assert model.model[0].ddp_config.overlap_grad_reduce == (overlap and world // (tp * pp) > 1)
    if overlap:
        assert len(model.model[0].buffers[0].buckets) > 1
    load_full_state_dict(model.module, full, cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    share = BATCH // dp
    mine = tokens[dp_rank * share : (dp_rank + 1) * share]
    micro = [{"tokens": mine[i : i + 1]} for i in range(share)]
    if uneven and dp_rank == 0:  # one micro-batch here, one a row on the other rank (micro-batches by tokens)
        micro = [{"tokens": mine}]
    total_tokens = BATCH * (SEQ - 1)

    def logp(batch, logits):
        return vocab_parallel_logprobs(
            logits[:, :-1], batch["tokens"][:, 1:], default_tp_group(), vocab_size=cfg.vocab_size
        )

    def loss_fn(batch, logits):
        nll = -logp(batch, logits).sum()
        return nll / total_tokens, {"nll_sum": nll.detach()}

    logps = model.forward(micro, logp)
    for _ in range(steps):  # megatron's DDP overlaps from the second step on (the first counts each bucket's grads)
        result = model.step(micro, loss_fn)
    if overlap:
        assert all(not g.is_first_batch for g in model.model[0].bucket_groups), "the overlapped path ran"
    metrics = {"grad_norm": result["grad_norm"], "nll_sum": sum(s["nll_sum"] for s in result["stats"])}
    grads = full_state_dict(model.module, cfg, grads=True)
    return {
        "logp": torch.cat(logps) if logps else None,
        "metrics": metrics,
        "grads": grads,
        "last_stage": ps.is_pipeline_last_stage(),
        "dp_rank": dp_rank,
    }


# The full weights and the one-process runs are shared by the tests (each is a process start, seconds on CI's cores)
@functools.cache
def _full(arch):
    return run_ranks(_full_weights, 1, arch)[0]


@functools.cache
def _base(arch, steps=1):
    return run_ranks(_run, 1, 1, 1, arch, _full(arch), False, steps)


def _compare(base, results, dp):
    ref = base[0]
    for r in results:
        for name, g in ref["grads"].items():
            torch.testing.assert_close(r["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"grad of {name}")
        assert r["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-5)
    # Every rank gets the results (TrainableModel broadcasts them from the last pipeline stage): all ranks of one
    # data-parallel slice hold the same log-probs and loss statistics.
    for r in results:
        same_slice = next(x for x in results if x["dp_rank"] == r["dp_rank"] and x["last_stage"])
        torch.testing.assert_close(r["logp"], same_slice["logp"], rtol=0, atol=0)
        assert r["metrics"]["nll_sum"] == same_slice["metrics"]["nll_sum"]
    last = [r for r in results if r["last_stage"]]
    logp = torch.cat([r["logp"] for r in sorted(last, key=lambda r: r["dp_rank"])][:dp]) if dp > 1 else last[0]["logp"]
    torch.testing.assert_close(logp, ref["logp"], rtol=1e-5, atol=1e-5)
    nll = sum(r["metrics"]["nll_sum"] for r in last[:dp]) if dp > 1 else last[0]["metrics"]["nll_sum"]
    assert nll == pytest.approx(ref["metrics"]["nll_sum"], rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tp2_matches_tp1(arch):
    _compare(_base(arch), run_ranks(_run, 2, 2, 1, arch, _full(arch)), dp=1)


def test_pp2_matches_pp1():
    _compare(_base("llama"), run_ranks(_run, 2, 1, 2, "llama", _full("llama")), dp=1)


@pytest.mark.parametrize("overlap", [False, True], ids=["reduce-after", "overlap-grad-reduce"])
def test_dp2_half_batches_match_one_big_batch(overlap):
    """With overlap, two steps: megatron's DDP launches bucket reductions from the backward only from the second
    step on; the second step's gradients (after one update) must still be one big batch's."""
    steps = 2 if overlap else 1
    _compare(_base("llama", steps), run_ranks(_run, 2, 1, 1, "llama", _full("llama"), overlap, steps), dp=2)


@pytest.mark.parametrize("overlap", [False, True], ids=["reduce-after", "overlap-grad-reduce"])
def test_dp2_ranks_with_different_micro_batch_counts_match_one_big_batch(overlap):
    """Micro-batches by tokens (`ppo.micro_batch_tokens`) give the DP ranks different numbers of micro-batches: one
    here, two there. The gradients are still summed once a step, in the same buckets on both ranks."""
    steps = 2 if overlap else 1
    _compare(_base("llama", steps), run_ranks(_run, 2, 1, 1, "llama", _full("llama"), overlap, steps, True), dp=2)
