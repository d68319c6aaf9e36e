"""Probe (issue 17, twenty-sixth session): the row quantization kernel against torch's e4m3 values, and a refit's
re-quantization of the FP8 decode weights by it against fp8.quantize_rows's eager pieces.

- values: rows.quantize_rows against fp8.quantize_rows on normal values, on values spread over 2^-20..1 of each
  row's largest (e4m3's subnormals and far below), float32 and bf16: how many e4m3 values and scales differ; the
  same for rows.add_parts_norm's quantized row against fp8.quantize_rows of its own normed row;
- requantize (GPU only: rows.quantize_into writes nothing elsewhere): fp8.DecodeFp8 over the 1B model's fc1, fc2,
  qkv and output weights (random bf16), eagerly and with quantize_into: values differing, ms per requantize.

    python3 benchmarks/probes/fp8_quantize.py --out result.json        (CUDA, sm_89+)
    TRITON_INTERPRET=1 python3 benchmarks/probes/fp8_quantize.py --tiny   (CPU: values compared only)
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import write_report  # noqa: E402

LAYERS, HIDDEN, FFN, QKV, VOCAB = 16, 2048, 8192, 4096, 32000  # the 1B model of docs/PERF.md


class _Weights:
    """What fp8.DecodeFp8 reads of the engine's weights: random bf16 of the model's shapes."""

    def __init__(self, layers: int, hidden: int, ffn: int, qkv: int, vocab: int, device):
        shapes = {"mlp.linear_fc1.weight": (2 * ffn, hidden), "mlp.linear_fc2.weight": (hidden, ffn)}
        shapes["self_attention.linear_qkv.weight"] = (qkv, hidden)
        self.num_layers = layers
        self.t = {
            f"decoder.layers.{i}.{name}": (torch.randn(shape, device=device) * 0.02).bfloat16()
            for i in range(layers)
            for name, shape in shapes.items()
        }
        self.output_weight = (torch.randn(vocab, hidden, device=device) * 0.02).bfloat16()

    def get(self, name: str) -> torch.Tensor:
        return self.t[name]


def _differing(a8: torch.Tensor, b8: torch.Tensor) -> int:
    return int((a8.view(torch.uint8) != b8.view(torch.uint8)).sum())


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU: small sizes, values compared only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from aligner.generation.native import fp8, rows

    gpu = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if gpu else "cpu")
    M, N = (256, 8192) if gpu else (8, 64)
    g = torch.Generator(device=device).manual_seed(0)

    def spread(m, n):  # values over 2^-20..1 of a row's largest
        return torch.randn(m, n, generator=g, device=device) * torch.exp2(
            torch.randint(-20, 1, (m, n), generator=g, device=device).float()
        )

    inputs = {
        "randn": torch.randn(M, N, generator=g, device=device),
        "wide": spread(M, N),
        "bf16 wide": spread(M, N // 4).bfloat16(),
    }
    report = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "values": {}, "requantize": {}}

    def compare(label, got8, got_s, ref8, ref_s):
        row = {"values": got8.numel(), "values_differing": _differing(got8, ref8)}
        row["scales_differing"] = int((got_s != ref_s).sum())
        report["values"][label] = row
        differ = f"{row['values_differing']} of {row['values']} values, {row['scales_differing']} scales"
        print(f"{label:18s} differing from torch's: {differ}", flush=True)

    for name, x in inputs.items():
        compare(name, *rows.quantize_rows(x), *fp8.quantize_rows(x))
    # the add+norm kernel's quantized row against torch's quantization of its own normed row (bf16), the norm's
    # weights spread over 2^-20..1 so that the rows reach e4m3's subnormals and below
    for name, x in inputs.items():
        x16 = x.bfloat16()
        parts = torch.randn(2, *x.shape, generator=g, device=device)
        w = spread(1, x.shape[1])[0].bfloat16() if name != "randn" else torch.ones(x.shape[1], device=device).bfloat16()
        _, h = rows.add_parts_norm(x16, parts, None, w, 1e-5)
        _, h8, hs = rows.add_parts_norm(x16, parts, None, w, 1e-5, quantize=True)
        compare(f"add+norm {name}", h8, hs, *fp8.quantize_rows(h))
    if gpu:
        weights = _Weights(LAYERS, HIDDEN, FFN, QKV, VOCAB, device)
        eager = fp8.DecodeFp8(weights, device, qkv=True)
        kernel = fp8.DecodeFp8(weights, device, qkv=True, quantize_into=rows.quantize_into)
        names = eager.names
        report["requantize"]["values_differing"] = sum(_differing(eager.w8[n], kernel.w8[n]) for n in names)
        report["requantize"]["scales_differing"] = sum(int((eager.scale[n] != kernel.scale[n]).sum()) for n in names)
        for label, copies in (("eager", eager), ("quantize_into", kernel)):
            copies.requantize(weights)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(5):
                copies.requantize(weights)
            torch.cuda.synchronize()
            report["requantize"][f"{label}_ms"] = (time.perf_counter() - start) / 5 * 1e3
        print("requantize:", report["requantize"], f"({eager.nbytes() / 1e9:.2f} GB of copies)", flush=True)
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
