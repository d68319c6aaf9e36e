"""What the probes in this folder share: their command lines, their random bf16 tensors, the engine probes' engine."""

import argparse
import ast
import importlib
import json
import time

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


def us_a_layer(every_layer, layers: int, gpu: bool) -> float:
    """The time of `every_layer()` (one call per layer) divided by `layers`, in us: on the GPU a CUDA graph of it
    replayed 30 times (benchmarks.decode_kernels.graph_time_us), on the CPU one eager pass (the interpreter: only
    that it runs)."""
    if gpu:
        from benchmarks.decode_kernels import graph_time_us

        return graph_time_us(every_layer, calls=1, replays=30) / layers
    start = time.perf_counter()
    every_layer()
    return (time.perf_counter() - start) / layers * 1e6


def engine_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The engine probes' command line: --decode-weights, --kv-dtype, --repeats, --preset, --batch-sizes (64 128),
    --set, --out; the caller may add its own options before parsing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--decode-weights", default="same", help="generation.decode_weights (same | fp8)")
    parser.add_argument("--kv-dtype", default="auto", help="generation.kv_dtype (auto | fp8)")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument(
        "--preset", choices=("1b", "8b"), default="1b", help="the model (benchmarks.generation.bench_model)"
    )
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128])
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="MODULE.NAME=VALUE",
        help="a constant of aligner.generation.native.MODULE set before the engine is built, e.g. "
        "triton_decode.FP8_MAXNREG=128 (settings compared in one tree)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the result here as JSON")
    return parser


def apply_settings(settings: list[str]) -> dict:
    """--set's MODULE.NAME=VALUE items applied to aligner.generation.native.MODULE (VALUE a Python literal); only
    names the module already has. Returns {item: value}."""
    applied = {}
    for item in settings:
        target, sep, text = item.partition("=")
        module_name, _, name = target.rpartition(".")
        if not sep or not module_name:
            raise SystemExit(f"--set {item!r}: write MODULE.NAME=VALUE, e.g. triton_decode.FP8_MAXNREG=128")
        module = importlib.import_module(f"aligner.generation.native.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"--set {item!r}: aligner.generation.native.{module_name} has no {name}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--set {item!r}: {text!r} is not a Python literal") from None
        setattr(module, name, value)
        applied[item] = value
    return applied


def bench_policy(args: argparse.Namespace, cfg):
    """bench_generation's model for `cfg` (seed 0, eval mode), after args.set's settings; initialises one process."""
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    initialize(1, 1)
    apply_settings(getattr(args, "set", []))
    torch.manual_seed(0)
    return build_gpt(cfg).eval()


def bench_engine(args: argparse.Namespace, cfg, prompt_len: int, new_tokens: int, policy=None, **gen_options):
    """(engine, device): a native engine of `policy` (default: bench_policy's) for args.batch_sizes, prompts of up to
    `prompt_len` tokens and `new_tokens` new ones, args.decode_weights, args.kv_dtype and `gen_options`."""
    from aligner.generation import GenerationConfig, build_engine

    policy = bench_policy(args, cfg) if policy is None else policy
    gen = GenerationConfig(
        max_batch_size=max(args.batch_sizes), max_prompt_length=prompt_len, max_response_length=new_tokens,
        decode_weights=args.decode_weights, kv_dtype=args.kv_dtype, **gen_options,
    )  # fmt: skip
    return build_engine(gen, cfg, policy), next(policy.parameters()).device


def write_report(report: dict, path: str | None) -> dict:
    """The probe's report, also written as JSON to `path` where given."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    return report


def engine_choices(engine) -> dict:
    """The kernels the engine chose where the config says auto (a failed start-up check shows here as cublas or
    torch): decode attention, decode GEMMs, token choice."""
    return {name: getattr(engine, name, None) for name in ("decode_attention", "decode_gemm", "token_choice")}
