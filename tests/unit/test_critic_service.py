"""CriticService in one process (world of one, no server): infer against a direct forward, the reward-function
path, value training, checkpoints, and bad inputs."""

import os

import numpy as np
import pytest
import torch
from critic_harness import (
    REPO,
    direct_values,
    init_single_process,
    sample_batch,
    save_weights,
    seeded_scalar_model,
    tiny_model,
)

from aligner.config.critic import CriticJobConfig
from aligner.critic.protocol import CriticRequestError


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Seeded critic and reward-model weights as dist checkpoints, plus the models themselves for direct forwards."""
    init_single_process()
    root = tmp_path_factory.mktemp("critic_weights")
    critic, rm = seeded_scalar_model(tiny_model(), 1), seeded_scalar_model(tiny_model(), 2)
    return {
        "critic": critic,
        "rm": rm,
        "critic_ckpt": save_weights(critic, str(root / "critic")),
        "rm_ckpt": save_weights(rm, str(root / "rm")),
    }


def _service(weights, tmp_path, reward="model", **overrides):
    from aligner.critic.service import CriticService

    cfg = CriticJobConfig(model=tiny_model(checkpoint=weights["critic_ckpt"]), exp_dir=str(tmp_path))
    if reward == "model":
        cfg.reward_model = tiny_model(checkpoint=weights["rm_ckpt"])
        cfg.reward_mean, cfg.reward_std = 0.5, 2.0
    else:
        cfg.reward_fn = os.path.join(REPO, "conf", "demo", "reward.py")
        cfg.tokenizer = os.path.join(REPO, "conf", "demo", "tokenizer.json")
    cfg.optim.lr = 3e-3
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 4, 2
    cfg.infer.micro_batch_size = 3
    cfg.server.max_batch_size = 16
    for key, value in overrides.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value) if name else setattr(cfg, section, value)
    cfg.validate()
    return CriticService(cfg)


def test_infer_equals_direct_forward(weights, tmp_path):
    service = _service(weights, tmp_path)
    tokens, lengths = sample_batch(7, 12, seed=3)  # 7 rows: micro-batches of 3 with a padded last one
    values, rewards = service.infer(tokens, lengths)
    assert values.shape == (7, 12) and values.dtype == torch.float32 and rewards.shape == (7, 1)
    valid = torch.arange(12)[None, :] < lengths[:, None]
    expect_v = direct_values(weights["critic"], tokens)
    torch.testing.assert_close(values[valid], expect_v[valid], rtol=0, atol=1e-5)
    assert (values[~valid] == 0).all()
    scores = direct_values(weights["rm"], tokens)[torch.arange(7), lengths - 1]
    torch.testing.assert_close(rewards[:, 0], (scores - 0.5) / 2.0, rtol=0, atol=1e-5)
    assert values[valid].std() > 0.05 and rewards.std() > 0.01  # the comparison is not between constants
    # Padding content cannot change the answer (causal model, values beyond the length are zero).
    garbage = tokens.clone()
    garbage[~valid] = 47
    v2, r2 = service.infer(garbage, lengths)
    torch.testing.assert_close(v2, values, rtol=0, atol=0)
    torch.testing.assert_close(r2, rewards, rtol=0, atol=0)


def test_reward_function_path(weights, tmp_path):
    import importlib.util

    from tokenizers import Tokenizer

    service = _service(weights, tmp_path, reward="fn")
    tok = Tokenizer.from_file(os.path.join(REPO, "conf", "demo", "tokenizer.json"))
    prompt_ids = tok.encode("say a: moon:", add_special_tokens=False).ids  # pieces: no <bos>
    responses = ["aaaa", "a b", "xyz"]
    rows = [prompt_ids + tok.encode(r, add_special_tokens=False).ids for r in responses]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    prompt_lengths = torch.full((3,), len(prompt_ids))
    _, rewards = service.infer(tokens, lengths, prompt_lengths, labels=["a", "b", None])

    spec = importlib.util.spec_from_file_location("demo_reward", os.path.join(REPO, "conf", "demo", "reward.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    expect = demo.reward_fn(["say a: moon:"] * 3, responses, ["a", "b", None])
    assert expect == [1.0, 1 / 3, 0.0]
    torch.testing.assert_close(rewards[:, 0], torch.tensor(expect, dtype=torch.float32))
    _, whole = service.infer(tokens, lengths)  # no prompt_lengths: the whole sequence is scored
    full = ["say a: moon:" + r for r in responses]
    torch.testing.assert_close(whole[:, 0], torch.tensor(demo.reward_fn([""] * 3, full), dtype=torch.float32))


def _train_batch(batch=6, seq=10, seed=5):
    tokens, lengths = sample_batch(batch, seq, seed=seed, min_len=4)
    pos = torch.arange(seq)[None, :]
    mask = ((pos >= 2) & (pos < lengths[:, None])).float()  # "response" = everything after a 2-token prompt
    gen = torch.Generator().manual_seed(seed)
    returns = torch.randn(batch, seq, generator=gen) * mask
    return tokens, lengths, returns, mask


def test_train_lowers_value_loss_and_reports_metrics(weights, tmp_path):
    from aligner.rl import explained_variance

    service = _service(weights, tmp_path, train__epochs=2)
    tokens, lengths, returns, mask = _train_batch()
    losses = []
    for _ in range(6):
        values, _ = service.infer(tokens, lengths)
        metrics = service.train(tokens, lengths, returns, values, mask)
        losses.append(metrics["loss"])
    assert losses[-1] < 0.6 * losses[0], losses
    assert metrics["steps"] == 4  # 6 rows in global batches of 4 -> 2 steps, 2 epochs
    assert metrics["tokens"] == mask.sum().item()
    assert 0 <= metrics["value_clipfrac"] <= 1 and metrics["grad_norm"] > 0 and metrics["lr"] == 3e-3
    ev = explained_variance(values, returns, mask).item()
    assert metrics["explained_variance"] == pytest.approx(ev, abs=1e-6)
    # Loss as the value loss of the service's first forward: 0.5 * (V - R)^2 over masked tokens (no clip yet).
    fresh = _service(
        weights, tmp_path / "fresh", train__epochs=1, train__global_batch_size=6, train__micro_batch_size=3
    )
    v0, _ = fresh.infer(tokens, lengths)
    first = fresh.train(tokens, lengths, returns, v0, mask)
    expect = (0.5 * (v0 - returns).square() * mask).sum() / mask.sum()
    assert first["loss"] == pytest.approx(expect.item(), rel=1e-5)
    assert first["value_clipfrac"] == 0.0  # V == V_old on the first step


def test_train_ignores_values_outside_the_mask(weights, tmp_path):
    tokens, lengths, returns, mask = _train_batch()
    a, b = _service(weights, tmp_path / "a"), _service(weights, tmp_path / "b")
    values, _ = a.infer(tokens, lengths)
    noisy_returns, noisy_values = returns.clone(), values.clone()
    noisy_returns[mask == 0] = float("nan")
    noisy_values[mask == 0] = 1e6
    ma = a.train(tokens, lengths, returns, values, mask)
    mb = b.train(tokens, lengths, noisy_returns, noisy_values, mask)
    assert ma == pytest.approx(mb, rel=1e-6, nan_ok=True)
    torch.testing.assert_close(a.infer(tokens, lengths)[0], b.infer(tokens, lengths)[0], rtol=0, atol=0)


def test_micro_batches_cut_to_their_longest_row_infer_and_train_the_same(weights, tmp_path):
    """trim_padding: rows sorted by length and each micro-batch cut to its longest row (rounded up), also by tokens
    (micro_batch_tokens), give the values, rewards and training of whole-width micro-batches in order; results go
    back to their own rows."""
    tokens, lengths = sample_batch(7, 12, seed=3)
    order = lengths.argsort(descending=True, stable=True)
    assert not torch.equal(order, torch.arange(7))  # sorting moves rows: a result in the wrong row would show
    budget = {"infer__micro_batch_tokens": 20, "train__micro_batch_tokens": 20}
    whole = _service(weights, tmp_path / "whole", trim_padding=0)
    cut = _service(weights, tmp_path / "cut", trim_padding=3)
    by_tokens = _service(weights, tmp_path / "tokens", trim_padding=3, **budget)
    lengths_np = lengths.numpy()
    widths = [mb["tokens"].shape[1] for mb in cut._micro_batches(3, None, lengths_np, tokens=tokens)]
    assert widths[0] == 12 and min(widths) < 12 and all(w % 3 == 0 for w in widths)
    assert [mb["tokens"].shape for mb in whole._micro_batches(3, None, lengths_np, tokens=tokens)] == [(3, 12)] * 3
    shapes = [tuple(mb["tokens"].shape) for mb in by_tokens._micro_batches(3, 20, lengths_np, tokens=tokens)]
    assert all(b * w <= 20 or b == 1 for b, w in shapes) and len(shapes) != len(widths)
    v_whole, r_whole = whole.infer(tokens, lengths)
    for service in (cut, by_tokens):
        values, rewards = service.infer(tokens, lengths)
        torch.testing.assert_close(values, v_whole, rtol=0, atol=1e-5)
        torch.testing.assert_close(rewards, r_whole, rtol=0, atol=1e-5)
    valid = torch.arange(12)[None, :] < lengths[:, None]
    torch.testing.assert_close(v_whole[valid], direct_values(weights["critic"], tokens)[valid], rtol=0, atol=1e-5)

    tokens, lengths, returns, mask = _train_batch(batch=7, seq=12, seed=8)
    values, _ = whole.infer(tokens, lengths)
    m_whole = whole.train(tokens, lengths, returns, values, mask)
    after = whole.infer(tokens, lengths)[0]
    for service in (cut, by_tokens):
        assert service.train(tokens, lengths, returns, values, mask) == pytest.approx(m_whole, rel=1e-4, abs=1e-6)
        torch.testing.assert_close(service.infer(tokens, lengths)[0], after, rtol=0, atol=1e-4)


def test_save_then_resume_gives_identical_values_and_optimizer(weights, tmp_path):
    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    assert service.resume(-1, "a1") is None  # a fresh run
    values, _ = service.infer(tokens, lengths)
    service.train(tokens, lengths, returns, values, mask)
    path = service.save(1, "a1")
    assert os.path.basename(path) == "step_000001" and os.path.isfile(os.path.join(path, "state.json"))
    trained, _ = service.infer(tokens, lengths)
    assert not torch.allclose(trained, values)

    resumed = _service(weights, tmp_path)
    assert resumed.resume(1, "a1") == path == resumed.resumed_from
    torch.testing.assert_close(resumed.infer(tokens, lengths)[0], trained, rtol=0, atol=0)
    assert resumed.critic.steps_taken == service.critic.steps_taken == 2
    # The optimizer state came back too: one more identical step gives identical weights.
    m1 = service.train(tokens, lengths, returns, trained, mask)
    m2 = resumed.train(tokens, lengths, returns, trained, mask)
    assert m1 == pytest.approx(m2, rel=1e-6)
    torch.testing.assert_close(resumed.infer(tokens, lengths)[0], service.infer(tokens, lengths)[0], rtol=0, atol=0)


def test_bad_inputs_raise_before_any_work(weights, tmp_path):
    service = _service(weights, tmp_path)
    tokens, lengths = sample_batch(3, 8)
    with pytest.raises(CriticRequestError, match="lengths\\[0\\]=9 is outside 1..T=8"):
        service.infer(tokens, lengths + 9 - lengths[0])
    with pytest.raises(CriticRequestError, match="exceeds server.max_batch_size=16"):
        service.infer(torch.ones(17, 8, dtype=torch.long), torch.ones(17, dtype=torch.long))
    with pytest.raises(CriticRequestError, match="prev_values has shape"):
        service.train(tokens, lengths, torch.zeros(3, 8), torch.zeros(3, 7), torch.zeros(3, 8))
    with pytest.raises(CriticRequestError, match="dtype float32; send int64"):
        service.infer(tokens.float(), lengths)
    values, rewards = service.infer(tokens, lengths)  # still serving
    assert np.isfinite(values.numpy()).all() and rewards.shape == (3, 1)


def test_critic_starts_from_a_policy_checkpoint(weights, tmp_path):
    """NeMo-Aligner's usual start: the critic's backbone from the (converted) policy, a fresh value head."""
    from aligner.models.gpt import build_gpt

    torch.manual_seed(11)
    policy = build_gpt(tiny_model(), head="lm")
    path = save_weights(policy, str(tmp_path / "policy"))
    service = _service({**weights, "critic_ckpt": path}, tmp_path / "exp")
    mine = service.critic.module.state_dict()
    for name, tensor in policy.state_dict().items():
        if torch.is_tensor(tensor) and not name.startswith("output_layer") and "_extra_state" not in name:
            assert torch.equal(mine[name], tensor), name
    assert mine["output_layer.weight"].shape == (1, 64)
    tokens, lengths = sample_batch(3, 8, seed=1)
    values, _ = service.infer(tokens, lengths)
    assert torch.isfinite(values).all()


def test_reward_only_mode_has_no_value_model(weights, tmp_path):
    """model: null: the reward model's scores as usual, values are zeros [B, 1]; training, resuming and saving are
    refused (the server binds none of them: the actor never sends them to this mode)."""
    from aligner.critic.service import CriticService

    cfg = CriticJobConfig(model=None, reward_model=tiny_model(checkpoint=weights["rm_ckpt"]), exp_dir=str(tmp_path))
    cfg.reward_mean, cfg.reward_std = 0.5, 2.0
    cfg.server.max_batch_size = 16
    cfg.validate()
    service = CriticService(cfg)
    assert service.critic is None and service.resumed_from is None
    tokens, lengths = sample_batch(5, 12, seed=4)
    values, rewards = service.infer(tokens, lengths)
    assert values.shape == (5, 1) and (values == 0).all()
    scores = direct_values(weights["rm"], tokens)[torch.arange(5), lengths - 1]
    torch.testing.assert_close(rewards[:, 0], (scores - 0.5) / 2.0, rtol=0, atol=1e-5)
    with pytest.raises(CriticRequestError, match="reward-only mode"):
        service.train(tokens, lengths, np.zeros((5, 12), np.float32), np.zeros((5, 12), np.float32), np.ones((5, 12)))
    with pytest.raises(CriticRequestError, match="reward-only mode"):
        service.save(1, "a1")
    with pytest.raises(CriticRequestError, match="reward-only mode"):
        service.resume(-1, "a1")


# -- the run's checkpoints (issue 14): the critic and the actor never resume as a mismatched pair ----------------
def test_critic_save_needs_the_runs_next_step_and_never_overwrites(weights, tmp_path):
    from aligner.critic.protocol import CriticCheckpointError

    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    with pytest.raises(CriticCheckpointError, match="sends critic_resume first"):
        service.save(0, "a1")
    service.resume(-1, "a1")
    values, _ = service.infer(tokens, lengths)
    service.train(tokens, lengths, returns, values, mask)
    with pytest.raises(CriticCheckpointError, match="has trained to step 1"):
        service.save(2**40 - 1, "a1")  # an absurd step never becomes the "latest"
    with pytest.raises(CriticCheckpointError, match="but the critic serves run a1"):
        service.save(1, "b2")
    assert service.save(1, "a1").endswith("step_000001")
    with pytest.raises(CriticCheckpointError, match="has trained to step 1"):
        service.save(0, "a1")
    fresh = _service(weights, tmp_path)  # a new critic job on the same directory
    fresh.resume(1, "a1")
    with pytest.raises(CriticCheckpointError, match="never overwritten"):
        fresh.base_step = 0  # pretend it was asked for step 1 again
        fresh.trains_since_base = 1
        fresh.save(1, "a1")


def test_a_failed_critic_save_is_a_checkpoint_refusal_and_can_be_retried(weights, tmp_path):
    """A real OS write failure (files may not grow past 1 KiB: EFBIG, as a full disk gives ENOSPC) reaches the actor
    as CriticCheckpointError (one line, exit 2 there), nothing of the step is left, and the same step saves once the
    limit is lifted (space freed)."""
    import resource
    import signal

    from aligner.critic.protocol import CriticCheckpointError

    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    service.resume(-1, "a1")
    values, _ = service.infer(tokens, lengths)
    service.train(tokens, lengths, returns, values, mask)
    old_handler, old_limit = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, old_limit[1]))
    try:
        with pytest.raises(CriticCheckpointError, match=r"cannot write checkpoint .*step_000001: .*GiB free there now"):
            service.save(1, "a1")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert os.listdir(service.cfg.checkpoint_dir) == []
    assert service.save(1, "a1").endswith("step_000001")


def test_critic_resume_checks_the_run_and_drops_uncommitted_steps(weights, tmp_path):
    from aligner.critic.protocol import CriticCheckpointError

    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    service.resume(-1, "a1")
    for step in (1, 2):
        values, _ = service.infer(tokens, lengths)
        service.train(tokens, lengths, returns, values, mask)
        service.save(step, "a1")
    ckpts = tmp_path / "checkpoints"
    # The actor committed step 1 only (it died before committing 2): resuming at 1 removes the critic's step 2.
    again = _service(weights, tmp_path)
    with pytest.raises(CriticCheckpointError, match="not to the actor's run b2"):
        again.resume(1, "b2")
    assert again.resume(1, "a1") == str(ckpts / "step_000001")
    assert sorted(os.listdir(ckpts)) == ["step_000001"]
    # A fresh run refuses a directory that holds another run's checkpoints.
    with pytest.raises(CriticCheckpointError, match="holds checkpoints of another run"):
        _service(weights, tmp_path).resume(-1, "c3")
    # ... and a critic that trained for a run cannot start another one.
    with pytest.raises(CriticCheckpointError, match="restart the critic job"):
        service.resume(-1, "c3")
    # A truncated file is named.
    victim = max((p for p in (ckpts / "step_000001" / "model").iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with pytest.raises(CriticCheckpointError, match=f"{victim.name} has .* bytes"):
        _service(weights, tmp_path).resume(1, "a1")


def test_poisoned_returns_skip_the_update_and_never_reach_the_weights(weights, tmp_path):
    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    values, _ = service.infer(tokens, lengths)
    huge = torch.where(mask > 0, torch.full_like(returns, 3e38), returns)  # finite, but the squared error is inf
    metrics = service.train(tokens, lengths, huge, values, mask)
    assert metrics["skipped_steps"] == metrics["steps"] > 0 and np.isnan(metrics["grad_norm"])
    after, _ = service.infer(tokens, lengths)
    torch.testing.assert_close(after, values, rtol=0, atol=0)  # no update happened
    good = service.train(tokens, lengths, returns, values, mask)  # and training goes on
    assert good["skipped_steps"] == 0 and np.isfinite(good["grad_norm"])
    assert np.isfinite(service.infer(tokens, lengths)[0].numpy()).all()


def test_checkpoint_with_pickled_code_does_not_run_it(weights, tmp_path):
    """RNG and CPU optimizer files load with weights_only=True: a crafted pickle is refused, never executed."""
    import pickle

    from aligner.checkpoint import dist_ckpt

    tokens, lengths, returns, mask = _train_batch()
    service = _service(weights, tmp_path)
    service.resume(-1, "a1")
    values, _ = service.infer(tokens, lengths)
    service.train(tokens, lengths, returns, values, mask)
    path = service.save(1, "a1")
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    rng = os.path.join(path, "rng", "rank_0.pt")
    torch.save({"torch": Exploit()}, rng, _use_new_zipfile_serialization=True, pickle_module=pickle)
    manifest = os.path.join(path, dist_ckpt.MANIFEST)
    os.remove(manifest)  # a crafted checkpoint would carry a matching manifest
    with pytest.raises(dist_ckpt.CheckpointError, match="rank_0.pt"):
        _service(weights, tmp_path).resume(1, "a1")
    assert not marker.exists()
