"""model.sdpa_kernel: the order in which the sdpa attention core asks PyTorch for its kernels on GPUs (cudnn: cuDNN's
attention first; default / auto: PyTorch's order), wired into every layer. On the CPU the order is not applied (SDPA
has one path there), so the model computes the same either way; on a GPU tests/gpu/train_families.py --sdpa-kernel
cudnn holds it to float32."""

import pytest
import torch
from torch.nn.attention import SDPBackend

from aligner.models.attention import SDPAttention, sdpa_backends


def test_the_choices_orders():
    assert sdpa_backends("auto") is None and sdpa_backends("default") is None
    assert sdpa_backends("cudnn") == [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]
    with pytest.raises(ValueError, match="model.sdpa_kernel must be auto, cudnn or default"):
        sdpa_backends("flash")


def test_every_layer_takes_the_order_and_computes_the_same():
    from critic_harness import init_single_process, tiny_model

    from aligner.models.gpt import build_gpt, forward

    init_single_process()
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(0))
    models = {
        choice: build_gpt(tiny_model(attention_backend="sdpa", sdpa_kernel=choice)) for choice in ("default", "cudnn")
    }
    models["cudnn"].load_state_dict(models["default"].state_dict())
    for choice, model in models.items():
        cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
        assert all(isinstance(core, SDPAttention) for core in cores) and len(cores) >= 2
        assert all(core.backends == sdpa_backends(choice) for core in cores)
    with torch.no_grad():
        a, b = (forward(model, ids) for model in models.values())
    torch.testing.assert_close(b, a, rtol=0, atol=0)
