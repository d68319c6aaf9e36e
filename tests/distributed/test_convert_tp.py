"""Conversion across layouts, on gloo ranks: the converter launched on 2 ranks builds TP=2 or PP=2 slices; a
checkpoint written at either layout loads into a TP=2 model whose logits/scores equal HF's (vocabulary padded to
256 at TP=2, 128 at TP=1); the reverse export (one process, TP=1) of each is bit-identical to the HF original.
A policy and a reward model trained one optimizer step by `TrainableModel` at TP=2 and saved with
`aligner.checkpoint.dist_ckpt.save` (the actor's checkpoint format) export to HF models whose logits/scores equal
ours after the step.
"""

import json
import os

import pytest
import torch
from convert_models import TOKENS_BT, VOCAB, hf_outputs, hf_tensors, make_hf
from dist import run_ranks

KINDS = ("llama", "qwen2", "gpt2", "llama_reward", "qwen3", "llama3_reward", "phi3", "smollm3")


def _gathered_outputs(model, reward: bool) -> torch.Tensor:
    """Full outputs of a TP-sharded model on TOKENS_BT: logits [B,T,VOCAB] (all TP slices) or values [B,T,1]."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from aligner.models.gpt import forward

    model.eval()
    with torch.no_grad():
        out = forward(model, TOKENS_BT)
    if reward:
        return out
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)[..., :VOCAB]


def _load(directory: str, reward: bool, model_yaml: str | None = None):
    from aligner.checkpoint.convert import load_model_yaml
    from aligner.checkpoint.dist_ckpt import load_model_weights
    from aligner.models.gpt import build_gpt

    cfg = load_model_yaml(model_yaml or os.path.join(directory, "model.yaml"))
    model = build_gpt(cfg, head="scalar" if reward else "lm")
    load_model_weights(directory, [model])
    return model


def _convert_pp2(rank, world_size, root):
    from aligner.checkpoint.convert import convert_hf_to_dist

    for kind in KINDS:
        convert_hf_to_dist(f"{root}/hf_{kind}", f"{root}/pp2_{kind}", tp=1, pp=2)
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def _tp2(rank, world_size, root):
    """Convert on 2 ranks at TP=2; load the TP=2 and the PP=2 checkpoints at TP=2; train one step, save."""
    from megatron.core import parallel_state as ps

    from aligner.checkpoint import dist_ckpt
    from aligner.checkpoint.convert import convert_hf_to_dist
    from aligner.config.schema import OptimConfig
    from aligner.models.logprobs import shift_for_next_token, vocab_parallel_logprobs
    from aligner.models.training import TrainableModel

    results = {}
    for kind in KINDS:
        convert_hf_to_dist(f"{root}/hf_{kind}", f"{root}/tp2_{kind}", tp=2)
        assert ps.get_tensor_model_parallel_world_size() == 2
        reward = kind.endswith("reward")
        for written in ("tp2", "pp2"):
            model = _load(f"{root}/{written}_{kind}", reward)
            results[(written, kind)] = _gathered_outputs(model, reward)

    def lm_loss(batch, logits):
        logits, targets = shift_for_next_token(logits, batch["tokens"])
        logp = vocab_parallel_logprobs(logits, targets, ps.get_tensor_model_parallel_group(), vocab_size=VOCAB)
        return -logp.mean(), {}

    def value_loss(batch, values):
        return (values.float().squeeze(-1) - 1.0).pow(2).mean(), {}

    for kind, loss in (("llama", lm_loss), ("llama_reward", value_loss)):
        reward = kind.endswith("reward")
        cfg_dir = f"{root}/tp2_{kind}"
        from aligner.checkpoint.convert import load_model_yaml

        trained = TrainableModel(
            load_model_yaml(f"{cfg_dir}/model.yaml"),
            OptimConfig(lr=0.05, clip_grad=0.0),
            head="scalar" if reward else "lm",
        )
        dist_ckpt.load_model_weights(cfg_dir, [trained.module])
        before = _gathered_outputs(trained.module, reward)
        trained.step([{"tokens": TOKENS_BT}], loss)
        after = _gathered_outputs(trained.module, reward)
        assert (after - before).abs().max() > 1e-3, "the optimizer step changed nothing: the test would be vacuous"
        dist_ckpt.save(f"{root}/run_{kind}", 1, [trained.module], trained.optimizer, {"consumed_samples": 2})
        results[("trained", kind)] = after
        if reward:
            results["trained_bias"] = float(trained.module.output_layer.bias)
    return results if rank == 0 else None


def _export(rank, world_size, root):
    from aligner.checkpoint.convert import convert_dist_to_hf

    for kind in KINDS:
        for written in ("tp2", "pp2"):
            convert_dist_to_hf(f"{root}/{written}_{kind}", f"{root}/back_{written}_{kind}")
    # A step directory carries no model.yaml: the converted directory the run started from provides it.
    convert_dist_to_hf(f"{root}/run_llama/step_000001", f"{root}/back_trained_llama", model_config=f"{root}/tp2_llama")
    with pytest.raises(Exception, match="--drop-score-bias"):
        convert_dist_to_hf(f"{root}/run_llama_reward/step_000001", f"{root}/x", model_config=f"{root}/tp2_llama_reward")
    convert_dist_to_hf(
        f"{root}/run_llama_reward/step_000001",
        f"{root}/back_trained_llama_reward",
        model_config=f"{root}/tp2_llama_reward",
        drop_score_bias=True,
    )


def test_convert_across_layouts_and_export_trained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    root = str(tmp_path)
    expected = {kind: hf_outputs(make_hf(kind, f"{root}/hf_{kind}")) for kind in KINDS}
    assert run_ranks(_convert_pp2, 2, root) == [2, 2]
    assert json.load(open(f"{root}/pp2_llama/conversion.json"))["converted_with_layout"] == [1, 2]
    results = run_ranks(_tp2, 2, root, timeout=600)[0]
    for kind in KINDS:
        for written in ("tp2", "pp2"):
            torch.testing.assert_close(
                results[(written, kind)],
                expected[kind],
                rtol=0,
                atol=1e-4,
                msg=f"{kind} written at {written}, loaded at TP=2",
            )
    run_ranks(_export, 1, root)
    for kind in KINDS:
        original = hf_tensors(f"{root}/hf_{kind}")
        for written in ("tp2", "pp2"):
            exported = hf_tensors(f"{root}/back_{written}_{kind}")
            assert sorted(exported) == sorted(original), (kind, written)
            for name, t in original.items():
                assert torch.equal(exported[name], t), (kind, written, name)

    policy = AutoModelForCausalLM.from_pretrained(f"{root}/back_trained_llama", attn_implementation="eager").eval()
    torch.testing.assert_close(hf_outputs(policy), results[("trained", "llama")], rtol=0, atol=1e-4)
    assert (hf_outputs(policy) - expected["llama"]).abs().max() > 1e-3
    reward = AutoModelForSequenceClassification.from_pretrained(
        f"{root}/back_trained_llama_reward", attn_implementation="eager"
    ).eval()
    bias = results["trained_bias"]
    assert bias != 0.0
    # HF's score layer has no bias: with --drop-score-bias every HF score is ours minus the trained bias.
    torch.testing.assert_close(hf_outputs(reward), results[("trained", "llama_reward")] - bias, rtol=0, atol=1e-4)
