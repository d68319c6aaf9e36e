"""aligner's norms (aligner.models.norm): fp32 weights, computed in the activation's dtype."""

import pytest
import torch
import torch.nn.functional as F

from aligner.models.norm import TorchNorm


class _Config:
    def __init__(self, normalization):
        self.normalization = normalization
        self.layernorm_zero_centered_gamma = False
        self.sequence_parallel = True


@pytest.mark.parametrize("kind", ["RMSNorm", "LayerNorm"])
def test_bf16_activations_use_the_weight_in_bf16_and_train_the_fp32_weight(kind):
    norm = TorchNorm(_Config(kind), 64, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    assert norm.weight.dtype == torch.float32 and norm.weight.sequence_parallel
    assert set(norm.state_dict()) == ({"weight"} if kind == "RMSNorm" else {"weight", "bias"})
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    w = norm.weight.detach().bfloat16()
    if kind == "RMSNorm":
        expected = F.rms_norm(x.detach(), (64,), w, 1e-5)
    else:
        expected = F.layer_norm(x.detach(), (64,), w, norm.bias.detach().bfloat16(), 1e-5)
    assert torch.equal(y.detach(), expected)
    y.float().square().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.dtype == torch.float32 and x.grad is not None
    # float32 activations: exactly torch's own module
    ref = (torch.nn.RMSNorm if kind == "RMSNorm" else torch.nn.LayerNorm)(64, eps=1e-5)
    ref.load_state_dict(norm.state_dict())
    x32 = torch.randn(8, 64)
    assert torch.equal(norm(x32), ref(x32))
