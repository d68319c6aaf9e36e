"""FP8 weights for the decode step's MLP, qkv and output layer (`generation.decode_weights: fp8`).

At batch 64 a decode step of the 1B benchmark model spends half its time in weight GEMMs that read each weight once
(memory-bound); the MLP's two projections and the output layer are most of those bytes. With `fp8` the engine keeps
an e4m3 copy of these weights, one float32 scale per output row (w ~ w8 * s_w[row]), re-quantized at every refit from
the engine's own weights (shared with the policy or copied), into the same buffers (captured graphs stay valid).
A decode step then quantizes the GEMM's input per row (x ~ x8 * s_x[row], in the compiled kernel that produces x),
multiplies x8 by w8^T in one cuBLAS FP8 GEMM with unit scales and a float32 result, and applies s_x[row] * s_w[col]
in the compiled kernel that consumes the result. At decode_gemm=splitk (TP=1, up to 128 rows) Triton kernels on
FP8 tensor cores do more of it: a SwiGLU fc1's product, both scales and the activation in one kernel
(splitk.gated_matmul_fp8), fc2 by the split-K kernel (splitk.matmul_fp8), and also qkv and the output layer, each
written in the engine's dtype with its scales applied (splitk.matmul_fp8, one K range; the norm before qkv then
quantizes its output too); with RMSNorm the add+norm+quantize kernels after the split-K GEMMs and the activation's
quantization are rows.py's. Above those kernels' 128 rows, fc1 and qkv stay on them in blocks of rows (up to
splitk.ROW_BLOCKS_MAX_BATCH rows; qkv above that), the output layer runs by cuBLAS's row-wise scaled FP8 GEMM
(matmul_rowwise), fc2 as described first.
Prefill runs its MLPs on the same copies by cuBLAS (compute-bound there: the FP8 tensor cores' rate), and qkv too
where the copies include it, by the row-wise scaled FP8 GEMM (matmul_rowwise: both scales applied in its epilogue).
Attention and proj stay in the engine's dtype (proj's input, the attention's output, would need a quantization
kernel of its own, and weights widened from e4m3 inside the kernel ran slower than bf16: docs/PERF.md).

What it changes: the tokens are drawn from a policy whose MLP, qkv and output weights and their inputs are rounded
to e4m3 (3 mantissa bits): a rollout slightly off the trained policy. The engine's log-probs move further from
training's (the benchmark reports both); PPO's ratio uses the training forward's own log-probs, as always.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3 value
_TINY = 1e-12  # floor of a scale: an all-zero row quantizes to zeros
_ROWS_PER_CHUNK = 8192  # weight rows quantized at once (bounds the float32 temporary at refit)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ x8 * scale, one scale per row (last dimension): the row's largest |value| maps to e4m3's largest finite
    value. Returns (x8 e4m3, scale float32 [..., 1])."""
    scale = x.abs().amax(-1, keepdim=True).float().clamp(min=_TINY) / E4M3_MAX
    return (x.float() / scale).to(E4M3), scale


def dequantize(y: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 GEMM's float32 result times its input rows' scales [M, 1] and its weight rows' scales [N]."""
    return (y * row_scale * col_scale).to(dtype)


def unavailable(device: torch.device) -> str | None:
    """Why FP8 decode weights cannot run here (None if they can): a GPU with FP8 tensor cores (compute capability 8.9
    or newer) or the CPU, and a tiny FP8 GEMM that must match float32 maths on the same rounded values."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper), this GPU has {major}.{minor}"
    try:
        g = torch.Generator(device=device).manual_seed(0)
        x8, xs = quantize_rows(torch.randn(16, 32, generator=g, device=device))
        w8, ws = quantize_rows(torch.randn(48, 32, generator=g, device=device))
        one = torch.ones((), device=device)
        y = dequantize(matmul(x8, w8, one), xs, ws.view(-1), torch.float32)
        ref = (x8.float() * xs) @ (w8.float() * ws).t()
        if not torch.allclose(y, ref, atol=1e-3, rtol=1e-3):
            return "PyTorch's FP8 GEMM answered differently from float32 maths here"
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here; the message says which
        return f"PyTorch's FP8 GEMM failed here ({type(exc).__name__}: {exc})"
    return None


def matmul(x8: torch.Tensor, w8: torch.Tensor, one: torch.Tensor, out_dtype=torch.float32) -> torch.Tensor:
    """x8 [..., K] @ w8 [N, K]^T, unit scales (the scales are applied by the next kernel: dequantize)."""
    if x8.dim() == 2:
        return torch._scaled_mm(x8, w8.t(), one, one, out_dtype=out_dtype)
    y = torch._scaled_mm(x8.reshape(-1, x8.shape[-1]), w8.t(), one, one, out_dtype=out_dtype)
    return y.view(*x8.shape[:-1], w8.shape[0])


def matmul_rowwise(
    x8: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """(x8 * x_scale[row]) @ (w8 * w_scale[row of w8])^T, x8 [..., K] with scales [..., 1], w8 [N, K] with scales
    [N]: one FP8 GEMM that applies both scales to its float32 sums and rounds once to `out_dtype` (PyTorch's
    row-wise scaled _scaled_mm; prefill's qkv on the FP8 copies)."""
    K, N = x8.shape[-1], w8.shape[0]
    y = torch._scaled_mm(
        x8.reshape(-1, K), w8.t(), x_scale.reshape(-1, 1), w_scale.view(1, N), out_dtype=out_dtype
    )  # fmt: skip
    return y.view(*x8.shape[:-1], N)


def rowwise_writes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the engine uses matmul_rowwise for results in `dtype` on `device`: on CUDA for bfloat16 only (the form
    run and measured on the H200; PyTorch's row-wise scaled FP8 GEMM has not taken other output dtypes in every
    release), on the CPU for any; elsewhere the unit-scale GEMM and the dequantizing kernel after it."""
    return dtype == torch.bfloat16 or torch.device(device).type != "cuda"


_LAYER_WEIGHTS = {1: "mlp.linear_fc1.weight", 2: "mlp.linear_fc2.weight", "qkv": "self_attention.linear_qkv.weight"}


class DecodeFp8:
    """The e4m3 copies of every layer's fc1 and fc2 (with `qkv`, also linear_qkv) and of the output layer, with their
    row scales; fixed buffers."""

    def __init__(self, weights, device: torch.device, qkv: bool = False, quantize_into=None):
        """`quantize_into(w, w8, scales) -> bool`: how requantize writes a weight's copy where it can
        (rows.quantize_into: one kernel a weight, where Triton's kernels run); otherwise, or where it answers False,
        quantize_rows in chunks of rows."""
        self.one = torch.ones((), device=device)
        self.has_qkv = qkv
        self._quantize_into = quantize_into
        parts = (1, 2, "qkv") if qkv else (1, 2)
        # the names of each layer's copies by part (1, 2: fc1, fc2; "qkv")
        layer_names = [{j: f"decoder.layers.{i}.{_LAYER_WEIGHTS[j]}" for j in parts} for i in range(weights.num_layers)]
        self.names = [n for names in layer_names for n in names.values()] + ["output"]
        self.w8, self.scale = {}, {}
        for name in self.names:
            w = self._source(weights, name)
            self.w8[name] = torch.empty(w.shape, dtype=E4M3, device=device)
            self.scale[name] = torch.empty(w.shape[0], dtype=torch.float32, device=device)
        # (w8, scales) per layer and part, looked up once: decode steps ask for them layer by layer
        self._layers = [{j: (self.w8[n], self.scale[n]) for j, n in names.items()} for names in layer_names]
        self.requantize(weights)

    @staticmethod
    def _source(weights, name: str) -> torch.Tensor:
        return weights.output_weight if name == "output" else weights.get(name)

    @torch.no_grad()
    def requantize(self, weights) -> None:
        """Quantize the engine's current weights into the same buffers (after every refit)."""
        for name in self.names:
            w, w8, scale = self._source(weights, name), self.w8[name], self.scale[name]
            if self._quantize_into is not None and self._quantize_into(w, w8, scale):
                continue
            for r in range(0, w.shape[0], _ROWS_PER_CHUNK):
                q, s = quantize_rows(w[r : r + _ROWS_PER_CHUNK])
                w8[r : r + _ROWS_PER_CHUNK].copy_(q)
                scale[r : r + _ROWS_PER_CHUNK].copy_(s.view(-1))

    def layer(self, i: int, j: int | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(w8, row scales) of layer i's fc{j} (j = 1, 2), or with j = "qkv" its linear_qkv (built with `qkv`)."""
        return self._layers[i][j]

    @property
    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w8["output"], self.scale["output"]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.w8, self.scale) for t in d.values())

    def replaced_nbytes(self, weights) -> int:
        """Bytes of the engine-dtype weights that decode steps no longer read."""
        return sum(t.numel() * t.element_size() for t in (self._source(weights, n) for n in self.names))

    def data_ptrs(self) -> dict[str, int]:
        return {f"fp8:{n}": t.data_ptr() for n, t in self.w8.items()}
