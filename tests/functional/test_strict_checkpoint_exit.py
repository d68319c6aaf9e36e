"""A checkpoint the config does not describe stops the critic job at start-up with one line naming the tensor and the
key to check, exit code 2 (strict loading; here a checkpoint without model.yaml, so nothing fills the config)."""

import os

from critic_harness import ServerProcess, free_ports
from dist import free_port


def test_a_checkpoint_with_qkv_biases_under_a_config_without_them_exits_2(tmp_path):
    from megatron.core import dist_checkpointing

    from aligner.config.schema import ModelConfig
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    initialize(1, 1, master_port=free_port())
    # The demo critic's shape (conf/ppo_critic_demo.yaml), with Qwen2's q/k/v biases the demo config does not have
    shape = ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=48,
        make_vocab_size_divisible_by=32,
        max_position_embeddings=128,
        add_qkv_bias=True,
    )
    os.makedirs(tmp_path / "ckpt" / "model")
    dist_checkpointing.save(build_gpt(shape).sharded_state_dict(), str(tmp_path / "ckpt" / "model"))
    server = ServerProcess(
        [
            "--config-name",
            "ppo_critic_demo",
            f"model.checkpoint={tmp_path / 'ckpt'}",
            f"server.port={free_ports(3)}",
            f"exp_dir={tmp_path / 'exp'}",
        ]
    )
    assert server.wait_exit(120) == 2, server.output[-3000:]
    assert "linear_qkv.bias" in server.output and "model.add_qkv_bias" in server.output
    assert "Traceback" not in server.output
