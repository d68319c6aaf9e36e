"""aligner/lazy_fusions.py: megatron-core's torch.compile'd fusions are compiled on their first call, not at import."""

import subprocess
import sys

import torch

from aligner.lazy_fusions import compile_on_first_call


def test_importing_megatron_after_aligner_leaves_inductor_unimported():
    code = (
        "import sys, aligner, megatron.core.models.gpt\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions import fused_bias_geglu, fused_bias_swiglu\n"
        "print(jit.jit_fuser.__name__, fused_bias_geglu.geglu.compile_on_first_call,\n"
        "      fused_bias_swiglu.swiglu.__name__, 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # the decorator megatron's fusions took; they keep their names; inductor's compiler not imported by the import
    assert out.stdout.split() == ["compile_on_first_call", "True", "swiglu", "False"], out.stdout


def test_the_first_call_compiles_with_the_decorators_arguments_once():
    graphs = []

    def backend(gm, example_inputs):  # a dynamo backend that records each graph it is given, then runs it as is
        graphs.append(gm)
        return gm.forward

    @compile_on_first_call(backend=backend)
    def gate(x, y):
        return torch.tanh(x) * y

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    assert torch.equal(gate(x, y), torch.tanh(x) * y) and len(graphs) == 1
    assert torch.equal(gate(x, y), torch.tanh(x) * y) and len(graphs) == 1  # compiled once, then reused
    assert gate.__name__ == "gate"
