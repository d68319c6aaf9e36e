"""The pipeline on the CPU demo models: SFT -> reward model (from the SFT backbone) -> PPO with the SFT policy as the
actor's model.checkpoint and the reward model as the critic's. On the way: the SFT checkpoint exports to HF
`*ForCausalLM` with equal logits; the reward model's exports to `*ForSequenceClassification` with identical scores,
and serves in the critic job standardised by the reward_stats.json it carries."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = ["say a: cat: aaaa", "say a: moon rain: xyz", "say a: sun:"]


def _run(cmd, timeout=600):
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _train(trainer, exp_dir, *overrides):
    script = os.path.join(ROOT, "scripts", f"train_{trainer}.py")
    _run([sys.executable, script, "--config-name", f"{trainer}_demo", f"exp_dir={exp_dir}", *overrides])
    (ckpt,) = os.listdir(os.path.join(exp_dir, "checkpoints"))
    return os.path.join(exp_dir, "checkpoints", ckpt)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    sft = _train("sft", root / "sft", "train.max_steps=20", "logging.progress_bar=false")
    rm = _train(
        "reward_model",
        root / "rm",
        "train.max_steps=15",
        f"model.checkpoint={sft}",  # an LM checkpoint: its backbone, a fresh scalar head
        "logging.progress_bar=false",
    )
    return root, sft, rm


def _tokens():
    from aligner.data.tokenizer import load_tokenizer

    tok = load_tokenizer(os.path.join(ROOT, "conf", "demo", "tokenizer.json"))
    return [[tok.bos_id] + tok.encode(t) for t in TEXTS]


def _convert(ckpt, out):
    _run([sys.executable, os.path.join(ROOT, "scripts", "convert_nemo_to_hf.py"), "--input", ckpt, "--output", out])


def _ours(rank, world, ckpt, rows, head):
    """Our model's logits (lm) or last-token scores (scalar) for each row, and the critic's rewards (scalar)."""
    from aligner.checkpoint import dist_ckpt
    from aligner.checkpoint.convert import load_model_yaml
    from aligner.config.critic import CriticJobConfig
    from aligner.critic.service import CriticService
    from aligner.models.gpt import build_gpt, forward
    from aligner.parallel import initialize

    initialize(seed=0)
    cfg = load_model_yaml(os.path.join(ckpt, "model.yaml"))
    model = build_gpt(cfg, head=head).eval()
    dist_ckpt.load_model_weights(ckpt, [model])
    with torch.no_grad():
        outs = [forward(model, torch.tensor([r]))[0] for r in rows]
    if head == "lm":
        return [o[:, : cfg.vocab_size] for o in outs], None
    scores = torch.stack([o[-1, 0] for o in outs])
    # model.yaml records where the model started (model.checkpoint: the SFT policy): point both at the RM itself
    served = dataclasses.replace(cfg, checkpoint=ckpt)
    critic_cfg = CriticJobConfig(model=served, reward_model=served, exp_dir=os.path.join(ckpt, "..", "..", "critic"))
    critic_cfg.checkpoint.resume = False
    critic_cfg.validate()
    service = CriticService(critic_cfg)
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    _, rewards = service.infer(tokens, torch.tensor([len(r) for r in rows]))
    return scores, rewards[:, 0]


def test_sft_checkpoint_exports_to_hf_with_equal_logits(checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    _, sft, _ = checkpoints
    _convert(sft, str(tmp_path / "hf"))
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager")
    rows = _tokens()
    ours, _ = run_ranks(_ours, 1, sft, rows, "lm")[0]
    with torch.no_grad():
        for row, logits in zip(rows, ours):
            torch.testing.assert_close(hf(torch.tensor([row])).logits[0], logits, rtol=1e-4, atol=1e-4)


def test_reward_model_exports_to_hf_and_serves_in_the_critic(checkpoints, tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, _, rm = checkpoints
    stats = json.loads(open(os.path.join(rm, "reward_stats.json")).read())
    _convert(rm, str(tmp_path / "hf"))  # no --drop-score-bias: the trained head's bias is still exactly 0
    hf = AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, attn_implementation="eager"
    )
    rows = _tokens()
    scores, rewards = run_ranks(_ours, 1, rm, rows, "scalar")[0]
    with torch.no_grad():
        theirs = torch.stack([hf(torch.tensor([r])).logits[0, 0] for r in rows])
    torch.testing.assert_close(theirs, scores, rtol=1e-4, atol=1e-4)
    assert scores.std() > 0
    expected = (scores - stats["reward_mean"]) / stats["reward_std"]
    torch.testing.assert_close(rewards, expected, rtol=1e-5, atol=1e-5)


def test_sft_then_reward_model_then_ppo(checkpoints):
    root, sft, rm = checkpoints
    exp = root / "ppo"
    proc = _run(
        [
            sys.executable,
            os.path.join(ROOT, "launchers", "local", "ppo.py"),
            "--exp-dir",
            str(exp),
            "--actor",
            f"model.checkpoint={sft}",
            "ppo.num_steps=3",
            "validation.every=0",
            "logging.progress_bar=false",
            "--critic",
            "reward_fn=null",
            "model@reward_model=tiny",
            "reward_model.vocab_size=48",
            "reward_model.make_vocab_size_divisible_by=32",
            "reward_model.max_position_embeddings=128",
            f"reward_model.checkpoint={rm}",
            f"model.checkpoint={rm}",  # the critic starts from the reward model, as NeMo-Aligner's does
        ],
        timeout=900,
    )
    assert proc.stdout.strip().splitlines()[-1] == f"metrics: {exp}/actor/metrics.jsonl"
    with open(exp / "actor" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["ppo/kl"] == 0.0 and all(r["rollout/reward_std"] > 0 for r in rows)
    stats = json.loads(open(os.path.join(rm, "reward_stats.json")).read())
    log = (exp / "critic.log").read_text()
    mean, std = stats["reward_mean"], stats["reward_std"]
    assert f"standardised with mean {mean:g}, std {std:g}, from {rm}/reward_stats.json" in log
