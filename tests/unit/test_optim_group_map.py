"""megatron's distributed optimizer, parameter numbering for its checkpoint maps (aligner.models.optim).

The inner optimizer's groups hold fp32 parameters first, then the main copies of bf16 ones; the map must follow
that order when a group mixes the two (the critic's no-weight-decay group: fp32 norms + the value head's bf16 bias).
"""

import torch

from aligner.models.optim import group_index_map


def test_mixed_group_numbers_fp32_first():
    norm1, norm2 = torch.zeros(64), torch.zeros(64)  # megatron's torch-norm fallback: fp32
    bias = torch.zeros(1, dtype=torch.bfloat16)  # the value head's bias
    w1, w2 = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(1, 64, dtype=torch.bfloat16)
    # group 0 (weight decay): bf16 matrices only; group 1 (no decay): the norms (fp32) and the bias (bf16).
    order = group_index_map(fp32_groups=[[], [norm1, norm2]], float16_groups=[[w1, w2], [bias]])
    assert order[w1] == (0, 0) and order[w2] == (0, 1)
    assert order[norm1] == (1, 0) and order[norm2] == (1, 1)
    assert order[bias] == (1, 2)  # after the group's fp32 parameters, whatever the gradient buffer's order


def test_one_dtype_groups_keep_their_order():
    a, b, c = (torch.zeros(n, dtype=torch.bfloat16) for n in (3, 4, 5))
    order = group_index_map(fp32_groups=[[], []], float16_groups=[[a, b], [c]])
    assert order == {a: (0, 0), b: (0, 1), c: (1, 0)}


def test_torch_adam_is_switched_to_its_fused_kernel_only_where_every_parameter_is_on_a_gpu():
    from types import SimpleNamespace

    from aligner.models.optim import fuse_torch_adam

    cpu = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    wrapped = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=cpu), SimpleNamespace(optimizer=None)])
    assert fuse_torch_adam(wrapped) == 0 and not cpu.param_groups[0]["fused"]
    if torch.cuda.is_available():  # (the GPU machine: the switch and the step counters on the device)
        gpu = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, device="cuda"))])
        p = gpu.param_groups[0]["params"][0]
        p.grad = torch.ones_like(p)
        gpu.step()
        assert fuse_torch_adam(SimpleNamespace(optimizer=gpu)) == 1
        assert gpu.param_groups[0]["fused"] and gpu.state[p]["step"].is_cuda
        gpu.step()
