"""Sequence parallelism (`model.sequence_parallel`) at TP=2: the same outputs and the same gradients as TP=2
without it, for the language-model head and the critic's scalar head, with a sequence length that is not a multiple
of TP (the schedule pads it and cuts the outputs back) and with a packed block-diagonal mask. What it saves is
activation memory on the GPU, not shown here."""

import pytest
import torch
from dist import run_ranks


def _run(rank, world, head, sequence_parallel, packed):
    from critic_harness import tiny_model

    from aligner.config import OptimConfig
    from aligner.data.packing import attention_mask_from_segments
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize

    initialize(tensor_parallel=world, seed=3)
    cfg = tiny_model(sequence_parallel=sequence_parallel)  # the CPU demo's llama shape
    model = TrainableModel(cfg, OptimConfig(lr=1e-2, clip_grad=0.0), head=head)
    assert model.module.config.sequence_parallel == sequence_parallel
    tokens = torch.randint(0, 48, (4, 11), generator=torch.Generator().manual_seed(0))  # 11: padded to 12
    micro = [{"tokens": tokens[:2]}, {"tokens": tokens[2:]}]
    if packed:  # two samples per row: 5 and 6 tokens, positions restarting at each
        segments = torch.tensor([[0] * 5 + [1] * 6] * 2)
        positions = torch.cat([torch.arange(5), torch.arange(6)]).expand(2, 11)
        for mb in micro:
            mb.update(attention_mask=attention_mask_from_segments(segments), position_ids=positions)

    def loss_fn(batch, out):
        assert out.shape[1] == 11, "outputs cut back to the input's length"
        loss = out.float().square().mean()  # vocab-parallel under TP: each rank's slice, the sum is the loss
        return loss, {"tokens": torch.tensor(1.0, dtype=torch.float64), "loss_sum": loss.detach().double()}

    before = model.forward(micro, lambda batch, out: out.float().clone())
    result = model.step(micro, loss_fn)
    # the step's gradients, as reduced for the optimizer (a norm's: summed over the TP ranks' sequence slices)
    grads = {n: p.main_grad.detach().clone() for n, p in model.module.named_parameters()}
    return before, result["grad_norm"], grads


@pytest.mark.parametrize("head, packed", [("lm", False), ("scalar", True)])
def test_sequence_parallel_changes_nothing_but_memory(head, packed):
    plain = run_ranks(_run, 2, head, False, packed)
    split = run_ranks(_run, 2, head, True, packed)
    for (out_a, norm_a, g_a), (out_b, norm_b, g_b) in zip(plain, split):
        for a, b in zip(out_a, out_b):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        assert norm_b == pytest.approx(norm_a, rel=1e-5) and norm_a > 0
        for name, g in g_a.items():  # the same sums in another order (and over one padding position): rounding
            assert g.abs().max() > 0, name
            torch.testing.assert_close(g_b[name], g, rtol=1e-4, atol=1e-6 * g.abs().max().item(), msg=name)
