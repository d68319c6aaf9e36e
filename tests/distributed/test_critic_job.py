"""The real critic job on two processes (torchrun, gloo, TP=2) answers like one rank, and SIGTERM ends it all.

The 2-rank job loads a checkpoint written at TP=1 (resharded on load); its answers are compared with a direct
forward and with a one-rank CriticService built here from the same checkpoint. Its critic_save (written at TP=2)
loads back at TP=1 to the values the job serves.
"""

import os
import signal
import sys

import pytest
import torch
from critic_harness import (
    ServerProcess,
    direct_values,
    free_ports,
    init_single_process,
    load_weights,
    model_yaml,
    sample_batch,
    save_weights,
    seeded_scalar_model,
    stub_model_folders,
    tiny_model,
    triton_workspaces,
    wait_gone,
)

from aligner.config.critic import CriticJobConfig
from aligner.critic import CriticClient


def test_tp2_job_matches_one_rank_and_stops_on_sigterm(tmp_path):
    from aligner.critic.service import CriticService

    init_single_process()
    critic = seeded_scalar_model(tiny_model(), 31)
    critic_ckpt = save_weights(critic, str(tmp_path / "critic"))
    rm_ckpt = save_weights(seeded_scalar_model(tiny_model(), 32), str(tmp_path / "rm"))
    port = free_ports(3)
    (tmp_path / "critic_tp2.yaml").write_text(
        f"model:\n{model_yaml(checkpoint=critic_ckpt)}reward_model:\n{model_yaml(checkpoint=rm_ckpt)}"
        "optim:\n  lr: 1.0e-3\ntrain:\n  global_batch_size: 4\n  micro_batch_size: 2\n"
        f"server:\n  port: {port}\n  heartbeat_s: 1.0\nexp_dir: {tmp_path / 'exp'}\n"
    )
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_ports(1)),
    ]
    server = ServerProcess(
        ["--config-path", str(tmp_path), "--config-name", "critic_tp2", "parallel.tensor_model_parallel_size=2"],
        launcher=launcher,
    )
    try:
        url = server.wait_ready(180)
        assert "2 rank(s): TP 2, PP 1, DP 1" in server.output

        # The one-rank reference: the same config at TP=1, in this process.
        cfg = CriticJobConfig(
            model=tiny_model(checkpoint=critic_ckpt),
            reward_model=tiny_model(checkpoint=rm_ckpt),
            exp_dir=str(tmp_path / "ref"),
        )
        cfg.optim.lr, cfg.train.global_batch_size, cfg.train.micro_batch_size = 1e-3, 4, 2
        reference = CriticService(cfg)

        tokens, lengths = sample_batch(6, 16, seed=7, min_len=5)
        pos = torch.arange(16)[None, :]
        mask = ((pos >= 2) & (pos < lengths[:, None])).float()
        returns = torch.cos(0.5 * pos).expand(6, 16) * mask
        with CriticClient(url, connect_timeout=60) as client:
            client.resume_async(None, "a1").result(120)  # a fresh run: critic_save then accepts step 1
            values, rewards = client.infer_async(tokens, lengths).result(120)
            ref_values, ref_rewards = reference.infer(tokens, lengths)
            valid = pos < lengths[:, None]
            torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5)
            torch.testing.assert_close(rewards, ref_rewards, rtol=0, atol=1e-5)
            torch.testing.assert_close(values[valid], direct_values(critic, tokens)[valid], rtol=0, atol=1e-5)

            metrics = client.train_async(tokens, lengths, returns, values, mask).result(120)
            ref_metrics = reference.train(tokens, lengths, returns, ref_values, mask)
            for key in ("loss", "value_clipfrac", "explained_variance", "tokens", "steps"):
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key
            assert metrics["grad_norm"] == pytest.approx(ref_metrics["grad_norm"], rel=1e-4)
            after, _ = client.infer_async(tokens, lengths).result(120)
            torch.testing.assert_close(after, reference.infer(tokens, lengths)[0], rtol=0, atol=1e-4)

            path = client.save(1, "a1")  # written at TP=2, read back at TP=1
            reloaded = direct_values(load_weights(tiny_model(), path), tokens)
            torch.testing.assert_close(after[valid], reloaded[valid], rtol=0, atol=1e-5)

        procs = server.descendants()
        leftovers = triton_workspaces(procs) | stub_model_folders(procs)
        assert len([p for p in procs if "serve_ppo_critic.py" in " ".join(p.cmdline())]) == 2
        server.signal(signal.SIGTERM)  # to torchrun, which passes it on to both ranks
        server.wait_exit(120)
        assert "SIGTERM received, stopping" in server.output, server.output[-4000:]
        assert wait_gone(procs) == []
        assert len(leftovers) == 5 and not any(os.path.exists(p) for p in leftovers)
    finally:
        if server.proc.poll() is None:
            server.kill()
