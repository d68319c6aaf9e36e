"""Activation recomputation (`model.recompute`): the same forward, the same gradients, the same step at TP=2;
and a bad chunk size is named. What it saves is memory on the GPU (docs/PERF.md), not shown here."""

import pytest
import torch
from dist import run_ranks


def _one_step(rank, world, recompute, method="uniform"):
    from aligner.config import ModelConfig, OptimConfig
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(tensor_parallel=world, seed=3)
    cfg = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        make_vocab_size_divisible_by=16,
        max_position_embeddings=32,
        recompute=recompute,
        recompute_method=method,
        recompute_num_layers=2 if method == "uniform" else 3,  # block: layers 1-3 recomputed, layer 4 kept
    )
    model = TrainableModel(cfg, OptimConfig(lr=1e-2, clip_grad=0.0))
    if recompute == "full":  # what megatron's transformer block reads to pick the layers it recomputes
        megatron = model.module.config
        assert (megatron.recompute_method, megatron.recompute_num_layers) == (method, cfg.recompute_num_layers)
    tokens = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(0))

    def loss_fn(batch, logits):
        loss = logits.float().square().mean()  # vocab-parallel under TP: each rank's slice, the sum is the loss
        return loss, {"tokens": torch.tensor(1.0, dtype=torch.float64), "loss_sum": loss.detach().double()}

    result = model.step([{"tokens": tokens[:2]}, {"tokens": tokens[2:]}], loss_fn)
    weights = {n: p.detach().clone() for n, p in model.module.named_parameters()}
    return result["grad_norm"], [s["loss_sum"] for s in result["stats"]], weights


def test_recomputation_changes_nothing_but_memory():
    world = 2  # TP=2: the sharded layers and megatron's RNG tracker inside the recomputed chunks
    plain = run_ranks(_one_step, world, "none")
    for recompute, method in (("selective", "uniform"), ("full", "uniform"), ("full", "block")):
        other = run_ranks(_one_step, world, recompute, method)
        for (norm_a, loss_a, w_a), (norm_b, loss_b, w_b) in zip(plain, other):
            assert loss_b == loss_a and norm_b == pytest.approx(norm_a, rel=1e-6), recompute
            for name, w in w_a.items():
                torch.testing.assert_close(w_b[name], w, rtol=0, atol=1e-7, msg=f"{recompute}: {name}")
    assert plain[0][0] > 0


def test_recompute_chunk_must_fit_the_model():
    from aligner.config import ConfigError, ModelConfig, ParallelConfig
    from aligner.config.schema import validate_layout, validate_model

    with pytest.raises(ConfigError, match="model.recompute_num_layers"):
        validate_model(ModelConfig(num_layers=3, recompute="full", recompute_num_layers=2))
    validate_model(ModelConfig(num_layers=3, recompute="full", recompute_method="block", recompute_num_layers=2))
    with pytest.raises(ConfigError, match="at most the 2 layers of a pipeline stage"):
        validate_layout(
            ModelConfig(num_layers=4, recompute="full", recompute_method="block", recompute_num_layers=3),
            ParallelConfig(pipeline_model_parallel_size=2),
            2,
        )
