"""Probe (issue 17, twenty-fourth session): what each piece of a decode step costs inside the step.

For each target, a fresh engine whose one function (a module's, or one of the decoder's compiled kernels: the kernels
it launches) is replaced, before the decode graph is captured, by a memo that runs the real function once per
argument shapes and then hands back that first output: the step keeps its other kernels, in the same order, and
loses only that piece's. The tokens are then wrong; what is measured is the decode step's time, as
generate_repeats.py measures it (median of --repeats greedy calls, the benchmark model, prompts of 128 tokens, 256
new tokens). The difference to `none` is what the piece costs in the step with its neighbours overlapping it (PDL),
which a kernel profile does not show.

    python3 benchmarks/probes/decode_ablation.py --decode-weights fp8 --batch-sizes 64 --out result.json
    python3 benchmarks/probes/decode_ablation.py --decode-weights fp8 --batch-sizes 256 \
        --targets none attention fc1 fp8_gemm act_quant cublas_fp8 rowwise_fp8 linear add_norm_q dq_add_norm_q
                                                                                  (256 rows: docs/PERF.md, 26th session)
"""

import argparse
import gc
import importlib
import os
import statistics
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from benchmarks.probes.common import bench_engine, engine_choices, engine_parser, write_report  # noqa: E402

# target -> (where, name): a function of a module under aligner.generation.native, a field of the decoder's compiled
# kernels ("kernels": fused.Kernels, the step's elementwise pieces), or a static method of the Decoder ("Decoder").
# Up to 128 rows (decode_gemm=splitk: the Triton GEMMs and row kernels; with FP8 weights fc1, qkv and the activation's
# quantization up to 512 rows, in row blocks above 128):
TARGETS = {
    "act_quant": ("rows", "quantize_rows"),  # the activation's quantization between fc1 and fc2 (FP8)
    "attention": ("triton_decode", "decode_attention"),
    "norm": ("rows", "add_parts_norm"),  # the add+norm(+quantize) kernels after proj and fc2
    "proj": ("splitk", "matmul"),  # the split-K GEMM in the engine's dtype (with FP8 weights: proj only)
    "fc1": ("splitk", "gated_matmul_fp8"),
    "fp8_gemm": ("splitk", "matmul_fp8"),  # qkv, fc2 and the output layer with FP8 weights
    # above 128 rows (cuBLAS and compiled kernels), FP8 weights (what runs there above 512 rows only: in brackets):
    "cublas_fp8": ("fp8", "matmul"),  # fc2 [and fc1] (unit scales)
    "rowwise_fp8": ("fp8", "matmul_rowwise"),  # the output layer [and qkv] (scales in the epilogue)
    "linear": ("Decoder", "_linear"),  # proj (cuBLAS in the engine's dtype; with bf16 weights every GEMM)
    "act_q": ("kernels", "act_q"),  # [fc1's scales, the activation and its quantization]
    "add_norm_q": ("kernels", "add_norm_q"),  # the residual add + norm + quantization after proj
    "dq_add_norm_q": ("kernels", "dq_add_norm_q"),  # fc2's scales, the residual add + norm + quantization
}


def memo(fn, replaced: list):
    """fn, run once per argument shapes (and non-tensor arguments); later calls get that first output back and are
    counted in `replaced`."""
    first = {}

    def answer(*args, **kwargs):
        key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a) for a in args)
        key += tuple(sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, (torch.Tensor, tuple))))
        if key in first:
            replaced.append(1)
            return first[key]
        first[key] = fn(*args, **kwargs)
        return first[key]

    return answer


def install(target: str, engine, replaced: list):
    """Put the target's memo in place (before the engine captures its graphs); returns what puts the real one back."""
    where, name = TARGETS[target]
    if where == "kernels":  # the decoder's compiled kernels, both sets (with and without PDL): the engine's own
        sets = {id(k): k for k in (engine.decoder.k, engine.decoder.k_pdl)}.values()
        for k in sets:
            if getattr(k, name) is not None:
                setattr(k, name, memo(getattr(k, name), replaced))
        return lambda: None  # the engine is dropped after its target
    if where == "Decoder":
        from aligner.generation.native.decoder import Decoder

        real = Decoder.__dict__[name]
        setattr(Decoder, name, staticmethod(memo(real.__func__, replaced)))
        return lambda: setattr(Decoder, name, real)
    module = importlib.import_module(f"aligner.generation.native.{where}")
    real = getattr(module, name)
    setattr(module, name, memo(real, replaced))
    return lambda: setattr(module, name, real)


def main(argv=None) -> dict:
    parser = engine_parser(__doc__, repeats=5)
    parser.add_argument("--targets", nargs="+", default=["none", *TARGETS], help=f"none and any of {list(TARGETS)}")
    parser.add_argument("--decode-attention", default=None, help="default: the config's")
    parser.add_argument("--tiny", action="store_true", help="bench_generation's 2-layer model (CPU smoke run)")
    args = parser.parse_args(argv)
    unknown = [t for t in args.targets if t != "none" and t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}: choose from none, {', '.join(TARGETS)}")

    from aligner.generation import SamplingParams
    from benchmarks.generation import _prompts, _timed, bench_model

    cfg = bench_model("tiny" if args.tiny else args.preset)
    prompt_len, new_tokens = (16, 16) if args.tiny else (128, 256)
    extra = {} if args.decode_attention is None else {"decode_attention": args.decode_attention}
    prompt_args = argparse.Namespace(prompt_len=prompt_len, ragged=False)
    report = {"args": vars(args), "targets": {}}
    for target in args.targets:
        engine, device = bench_engine(args, cfg, prompt_len, new_tokens, **extra)  # its start-up checks: real
        report.setdefault("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
        report.setdefault("engine", engine_choices(engine))
        replaced: list = []
        restore = install(target, engine, replaced) if target != "none" else None
        try:
            rng = torch.Generator().manual_seed(1)
            row = {}
            for B in args.batch_sizes:
                prompts, lengths = _prompts(prompt_args, B, cfg.vocab_size, rng, device)
                sp = SamplingParams(greedy=True, ignore_eos=True)
                engine.generate(prompts, lengths, sp)  # warm-up: captures the graphs (with the memo in them)
                decode_ms = []
                for _ in range(args.repeats):
                    _timed(partial(engine.generate, prompts, lengths, sp), device)
                    t = engine.last_timings
                    decode_ms.append(t["decode_ms"] / max(1, t["decode_steps"]))
                row[str(B)] = {"decode_ms": decode_ms, "median": statistics.median(decode_ms)}
                print(f"{target:10s} B={B} decode ms median {row[str(B)]['median']:.4f} min {min(decode_ms):.4f}")
            report["targets"][target] = {"batches": row, "calls_replaced": len(replaced)}
        finally:
            if restore is not None:
                restore()
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return write_report(report, args.out)


if __name__ == "__main__":
    main()
