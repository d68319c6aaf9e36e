"""`model.rope_fusion`: aligner's compiled RoPE (aligner.models.rope_fusion) in megatron's fused-RoPE seam computes what
megatron's unfused RoPE computes, forward and backward, in a real megatron GPTModel (torch.compile on the CPU here;
on the GPU it is the Triton kernel whose speed docs/PERF.md records)."""

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from aligner.models import rope_fusion as rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [8, 4])
def test_the_formula_is_megatrons_unfused_rope(dtype, rot):
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 2, 3, 8, generator=g).to(dtype)
    freqs = torch.randn(6, 1, 1, rot, generator=g) * 5
    assert torch.equal(rope.rope_bshd(t, freqs), _apply_rotary_pos_emb_bshd(t, freqs))


def test_a_model_with_fused_rope_matches_the_unfused_one():
    from critic_harness import init_single_process, tiny_model

    from aligner.models.gpt import build_gpt, forward

    init_single_process()
    plain = build_gpt(tiny_model(rope_fusion="off"))
    fused = build_gpt(tiny_model(rope_fusion="on"))
    fused.load_state_dict(plain.state_dict())
    assert fused.config.apply_rope_fusion and not plain.config.apply_rope_fusion
    from megatron.core.models.common.embeddings import rope_utils

    assert rope.install() == "aligner" and rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope
    for length in (9, 12):  # a second length: the compiled kernel takes new shapes
        tokens = torch.randint(0, 48, (2, length), generator=torch.Generator().manual_seed(length))
        outs = []
        for model in (plain, fused):
            model.zero_grad()
            logits = forward(model, tokens)
            logits.float().square().mean().backward()
            outs.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        (a, ga), (b, gb) = outs
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        for name, grad in ga.items():
            torch.testing.assert_close(gb[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert rope._compiled is not None, "the fused path ran"


def test_auto_is_on_only_on_a_gpu_with_triton():
    assert not rope.wanted("auto", rope=True, interleaved=False, gpu=False)
    assert not rope.wanted("on", rope=False, interleaved=False, gpu=True)  # learned positions (GPT-2)
    assert not rope.wanted("off", rope=True, interleaved=False, gpu=True)
    assert rope.wanted("on", rope=True, interleaved=False, gpu=False)
