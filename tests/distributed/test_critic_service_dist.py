"""CriticService on two gloo ranks, at DP=2, TP=2 and PP=2, against the same service on one rank.

Same weights (one dist checkpoint), same requests: infer must give the same values and rewards, and one train call
the same metrics and the same updated critic. At DP=2 the 5-row batch splits 3/2 for infer; training runs global
batches of 4 then 1 rows, so in the second step rank 1 has no row and joins the gradient reduction with an empty
micro-batch, which must change nothing.
"""

import pytest
import torch
from critic_harness import init_single_process, sample_batch, save_weights, seeded_scalar_model, tiny_model
from dist import run_ranks

from aligner.config.critic import CriticJobConfig


def _config(critic_ckpt, rm_ckpt, exp_dir, tp=1, pp=1) -> CriticJobConfig:
    cfg = CriticJobConfig(
        model=tiny_model(checkpoint=critic_ckpt),
        reward_model=tiny_model(checkpoint=rm_ckpt),
        reward_mean=0.25,
        reward_std=1.5,
        exp_dir=exp_dir,
    )
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.pipeline_model_parallel_size = pp
    cfg.optim.lr = 1e-3
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 2
    cfg.infer.micro_batch_size = 2
    cfg.validate()
    return cfg


def _batch():
    tokens, lengths = sample_batch(5, 12, seed=4, min_len=5)
    pos = torch.arange(12)[None, :]
    mask = ((pos >= 2) & (pos < lengths[:, None])).float()
    returns = torch.randn(5, 12, generator=torch.Generator().manual_seed(9)) * mask
    return tokens, lengths, returns, mask


def _exercise(service):
    tokens, lengths, returns, mask = _batch()
    values, rewards = service.infer(tokens, lengths)
    metrics = service.train(tokens, lengths, returns, values, mask)
    after, _ = service.infer(tokens, lengths)
    return {"values": values, "rewards": rewards, "metrics": metrics, "after": after}


def _two_rank_body(rank, world_size, critic_ckpt, rm_ckpt, exp_dir):
    from megatron.core import parallel_state

    from aligner.critic.service import CriticService
    from aligner.parallel import initialize

    out = {}
    for name, tp, pp in (("dp2", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)):
        initialize(tp, pp)
        assert parallel_state.get_data_parallel_world_size() == 2 // (tp * pp)
        out[name] = _exercise(CriticService(_config(critic_ckpt, rm_ckpt, f"{exp_dir}/{name}", tp, pp)))
        parallel_state.destroy_model_parallel()
    return out


def test_two_ranks_match_one_rank(tmp_path):
    from aligner.critic.service import CriticService

    init_single_process()
    critic_ckpt = save_weights(seeded_scalar_model(tiny_model(), 21), str(tmp_path / "critic"))
    rm_ckpt = save_weights(seeded_scalar_model(tiny_model(), 22), str(tmp_path / "rm"))
    ref = _exercise(CriticService(_config(critic_ckpt, rm_ckpt, str(tmp_path / "ref"))))
    assert ref["metrics"]["steps"] == 2 and ref["values"].std() > 0.05

    results = run_ranks(_two_rank_body, 2, critic_ckpt, rm_ckpt, str(tmp_path))
    for name in ("dp2", "tp2", "pp2"):
        for rank, got in enumerate(results):
            where = f"{name} rank {rank}"
            torch.testing.assert_close(got[name]["values"], ref["values"], rtol=0, atol=1e-5, msg=where)
            torch.testing.assert_close(got[name]["rewards"], ref["rewards"], rtol=0, atol=1e-5, msg=where)
            for key in ("loss", "value_clipfrac", "explained_variance", "value_mean", "tokens", "steps"):
                assert got[name]["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), where
            assert got[name]["metrics"]["grad_norm"] == pytest.approx(ref["metrics"]["grad_norm"], rel=1e-4), where
            torch.testing.assert_close(got[name]["after"], ref["after"], rtol=0, atol=1e-4, msg=where)
    assert not torch.allclose(ref["after"], ref["values"], atol=1e-3)  # the step moved the critic
