"""What the decode probes in this folder share: their command line and their random bf16 tensors."""

import argparse

import torch


def parse_args(doc: str, argv=None, quick: str | None = None) -> argparse.Namespace:
    """--batch (64), --out (the result as JSON) and, where the probe has a short form, --quick (help `quick`)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    return parser.parse_args(argv)


def randn(device: torch.device, dtype: torch.dtype = torch.bfloat16):
    """rand(*shape, std=0.02): normal values of that spread, in `dtype` on `device`."""

    def rand(*shape, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype) * std

    return rand
