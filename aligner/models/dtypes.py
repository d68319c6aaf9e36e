"""The one map between dtype names and torch dtypes.

Configs hold names (aligner.config.schema.Dtype, torch-free); everything that needs the torch dtype converts here.
"""

from __future__ import annotations

import typing

import torch

from aligner.config.schema import Dtype

NAMES = typing.get_args(Dtype)

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in NAMES}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """float32 | bfloat16 | float16 -> the torch dtype; other names raise ValueError listing these."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: use one of {', '.join(NAMES)}") from None
