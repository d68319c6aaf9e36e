"""When a decode step's kernels launch with programmatic dependent launch (aligner.generation.native.pdl): never off
CUDA (Triton's interpreter, CPU engines), never above pdl.MAX_BATCH rows (measured up to there), never when switched
off; the compiled kernels get inductor's PDL option only where it is wanted. The kernels' results with PDL are checked
on GPUs (docs/PERF.md: the engine's log-prob mismatch unchanged); here their PDL-free form runs under the
interpreter (test_splitk.py, test_triton_decode.py)."""

import torch

from aligner.generation.native import pdl


def test_pdl_only_on_cuda_up_to_its_batch_limit(monkeypatch):
    assert not pdl.wanted(torch.device("cpu"), 1)
    assert not pdl.wanted("cpu", pdl.MAX_BATCH)
    assert not pdl.wanted("cuda", pdl.MAX_BATCH + 1)  # decided before any CUDA query
    assert pdl.inductor_options("cpu") == {}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert not pdl.wanted("cuda", 1)
    assert pdl.inductor_options("cuda") == {}
