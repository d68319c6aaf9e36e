"""The optimizer step's finiteness check (`aligner.models.training.all_finite`), which reads a gradient buffer in
chunks so that its boolean mask stays small: a non-finite value anywhere, in any chunk, is found."""

import pytest
import torch

from aligner.models.training import FINITE_CHUNK, all_finite


@pytest.mark.parametrize("chunk", [1, 3, 4, 10, FINITE_CHUNK])
def test_a_non_finite_value_in_any_chunk_is_found(chunk):
    t = torch.arange(10, dtype=torch.float32).view(2, 5)
    assert all_finite(t, chunk).item() == 1
    for i in range(10):
        for bad in (float("nan"), float("inf"), float("-inf")):
            poisoned = t.clone()
            poisoned.view(-1)[i] = bad
            assert all_finite(poisoned, chunk).item() == 0, (i, bad)
