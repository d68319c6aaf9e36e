"""Compile aligner's Triton kernels (the engine's, the training models' RoPE) for the H200 (sm_90) and for an A100
(sm_80) on a machine without a GPU.

The CPU tests run our kernels under Triton's interpreter, which executes them with numpy and checks no types: a
kernel that computes the right values there can still fail Triton's compiler on a GPU (a variable whose type changes
inside a runtime branch, an FP8 product with K < 32; both happened, both were found on the H200 only). Triton
compiles for a GPU target without one (its ptxas ships in the wheel), so:

    python tests/triton_sm90.py record OUT.json    (TRITON_INTERPRET=1 is set here: the engine runs on the CPU in
                                                    bf16 with every Triton path on, each kernel launch recorded)
    python tests/triton_sm90.py compile OUT.json   (a fresh process: the interpreter patches triton.language)

`record` runs Llama, Qwen3-style (q/k norms) and GPT-2 (learned positions) models with the engine's own dtype
(greedy and sampled), FP8 decode weights and an FP8 KV cache (greedy), and the RoPE kernel forward and backward;
`compile` builds each distinct specialization (argument types, constexprs, warps and stages) to a cubin for sm_90,
with the constexprs that depend on the device set as the GPU's launchers set them (GPU_CONSTEXPRS), and those
without FP8 for sm_80 too (TARGETS). Each argument is specialized as Triton's JIT specializes it on the GPU (its own
function: pointers and ints divisible by 16 compiled with that alignment, which is what lets Triton pipeline the
loads through shared memory; an int equal to 1 compiled in), so the cubins are the pipelined forms the GPU runs.
Prints one line per kernel specialization with the shared memory a program holds; exit 1 if any fails to compile or
needs more shared memory than the target gives a program (SHARED_LIMIT); those over the 99 KiB of Ada / A10-class
cards are counted.
Steps above 128 rows are recorded at 3 rows with the row limits lowered (splitk.MAX_BATCH, GATED_MAX_BATCH,
triton_decode.WIDE_MIN_BATCH).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# constexprs the launchers set from the device (the CPU run records the interpreter's values): on an H200 in bf16
GPU_CONSTEXPRS = {
    "EMULATE": False,  # rows.py: the interpreter's bf16 rounding by hand
    "PDL": True,  # pdl.wanted: Hopper, up to pdl.MAX_BATCH rows
    "RECIPROCAL": True,  # rows.py: torch divides by a scalar as a product with its reciprocal on CUDA
    "WIDEN": False,  # splitk.py: the interpreter's products widened to float32
    "NATIVE_QK": True,  # triton_decode.py: 16-bit operands on a GPU
    "NATIVE_PV": True,
}
# the GPUs compiled for: the H200's sm_90, and an A100's sm_80 (no PDL there: pdl.wanted; no FP8 kernels; compiled,
# never run on an A100)
TARGETS = {"sm_90": (90, {}), "sm_80": (80, {"PDL": False})}
# the most shared memory a program may hold (bytes): Triton refuses to launch a kernel needing more. Ada and the A10
# / A40 class (sm_86, sm_89) allow 99 KiB: counted and printed, not compiled for
SHARED_LIMIT = {"sm_90": 227 * 1024, "sm_80": 163 * 1024}
SMALL_SHARED = 99 * 1024


def _specialization(kernel, name: str, index: int, value) -> tuple[str, object]:
    """How Triton's JIT sees one runtime argument (its own function): (type, key) with key "D" for a pointer or int
    divisible by 16 (compiled with that alignment: the pipelined loads), "" otherwise, or ("constexpr", 1) for an
    int equal to 1; the kernel's do_not_specialize names keep their plain type."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    plain = kernel.kwargs.get("do_not_specialize") or ()
    specialize = name not in plain and index not in plain
    return native_specialize_impl(BaseBackend, value, False, specialize, True)


def record(path: str) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from aligner.config.schema import ModelConfig
    from aligner.generation import GenerationConfig, SamplingParams, build_engine
    from aligner.models.gpt import build_gpt
    from aligner.parallel import initialize

    specs = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        import inspect

        params = inspect.signature(self.fn).parameters
        bound = dict(zip(params, args), **{k: v for k, v in kwargs.items() if k in params})
        signature, constexprs, aligned = {}, {}, []
        for index, (name, p) in enumerate(params.items()):
            value = bound.get(name, p.default)
            if "constexpr" in str(p.annotation) or value is None:
                signature[name], constexprs[name] = "constexpr", value
                continue
            signature[name], key = _specialization(self, name, index, value)
            if signature[name] == "constexpr":  # an int equal to 1: the JIT compiles it in
                constexprs[name] = key
            elif key == "D":
                aligned.append(name)
        options = {k: v for k, v in kwargs.items() if k not in params}
        spec = {
            "module": self.fn.__module__,
            "qualname": self.fn.__qualname__,
            "signature": signature,
            "constexprs": constexprs,
            "aligned": aligned,
            "options": options,
        }
        specs[json.dumps(spec, sort_keys=True)] = spec
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    from aligner.generation.native import triton_decode

    triton_decode.GROUP_PREFIX = True  # (off in the engine, a switch the probes turn on: its start-up call compiles)
    initialize(1, 1, master_port=int(os.environ.get("MASTER_PORT", "0")) or None)
    base = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=512)
    base.update(vocab_size=250, params_dtype="bfloat16")
    models = {
        "llama": ModelConfig(arch="llama", **base),
        "qwen3": ModelConfig(arch="llama", head_dim=64, qk_layernorm=True, **base),
        "gpt2": ModelConfig(
            arch="gpt2", tie_embeddings=True, max_position_embeddings=64, **{**base, "num_query_groups": None}
        ),
    }
    prompts = torch.randint(0, 250, (3, 8), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([8, 3, 5])
    for name, cfg in models.items():
        model = build_gpt(cfg).eval()
        # FP8 decode weights add kernels of their own only with Llama's shapes (no new one for the others)
        for extra in (
            ({}, {"decode_weights": "fp8"}, {"kv_dtype": "fp8"}) if name == "llama" else ({}, {"kv_dtype": "fp8"})
        ):
            gen = GenerationConfig(
                max_batch_size=3, max_prompt_length=8, max_response_length=4, decode_attention="triton",
                decode_gemm="splitk", token_choice="triton", **extra,
            )  # fmt: skip
            engine = build_engine(gen, cfg, model)
            # sampled as well as greedy with each model's own dtype: the token-choice kernels' specializations do not
            # change with FP8 weights or cache (a sampled call there added none), and each call costs seconds here
            samplings = [SamplingParams(greedy=True)] + ([SamplingParams(temperature=1.0, seed=2)] if not extra else [])
            for sampling in samplings:
                engine.generate(prompts, lengths, sampling)
            print(f"recorded {name} {extra or 'engine dtype'}: {len(specs)} specializations so far", flush=True)
    # what steps of 129-512 rows take, at 3 rows: the limits lowered (FP8 fc1 and qkv in blocks of ROW_BLOCK rows,
    # proj and fc2 by cuBLAS, 64 attention slots a step)
    from aligner.generation.native import splitk

    splitk.MAX_BATCH = splitk.GATED_MAX_BATCH = 2
    triton_decode.WIDE_MIN_BATCH = 3
    gen = GenerationConfig(
        max_batch_size=3, max_prompt_length=8, max_response_length=4, decode_attention="triton", decode_gemm="splitk",
        token_choice="triton", decode_weights="fp8",
    )  # fmt: skip
    engine = build_engine(gen, models["llama"], build_gpt(models["llama"]).eval())
    engine.generate(prompts, lengths, SamplingParams(greedy=True))
    print(f"recorded llama fp8 as above 128 rows: {len(specs)} specializations", flush=True)
    # the training models' RoPE (model.rope_fusion), forward and backward in bf16: rotating the whole head, then half
    from aligner.models import rope_fusion

    for rot in (64, 32):
        t = torch.randn(5, 2, 4, 64, dtype=torch.bfloat16, requires_grad=True)
        rope_fusion.rope_kernel(t, torch.randn(5, 1, 1, rot)).float().sum().backward()
    print(f"recorded the RoPE kernel: {len(specs)} specializations", flush=True)
    with open(path + ".tmp", "w") as f:
        json.dump(list(specs.values()), f, indent=1)
    os.replace(path + ".tmp", path)
    return 0


def _kernel(module: str, qualname: str):
    """The JITFunction `qualname` ("factory.<locals>.kernel") of `module`: the factory called (no arguments), the
    kernel found in what it returns, or the module's own global."""
    mod = importlib.import_module(module)
    if ".<locals>." not in qualname:
        return getattr(mod, qualname)
    factory, name = qualname.split(".<locals>.")
    made = getattr(mod, factory)()
    for item in made if isinstance(made, (tuple, list)) else made.values() if isinstance(made, dict) else [made]:
        if getattr(item, "__name__", None) == name or getattr(getattr(item, "fn", None), "__name__", None) == name:
            return item
    raise LookupError(f"{module}.{factory}() returned no kernel named {name}")


def _uses_fp8(spec: dict) -> bool:
    return any("fp8" in t for t in spec["signature"].values()) or bool(spec["constexprs"].get("KV_FP8"))


def compile_all(path: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)  # the test suite's conftest sets it; compiling needs it off
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    specs = json.load(open(path))
    seen_overrides, failures, done, large = set(), 0, set(), 0
    for target, (capability, overrides) in TARGETS.items():
        for spec in specs:
            if capability < 89 and _uses_fp8(spec):  # FP8 tensor cores: sm_89+ (fp8.unavailable refuses below)
                continue
            constexprs = dict(spec["constexprs"])
            for name, value in {**GPU_CONSTEXPRS, **overrides}.items():
                if name in constexprs:
                    constexprs[name] = value
                    seen_overrides.add(name)
            options = {k: v for k, v in spec["options"].items() if k in ("num_warps", "num_stages", "maxnreg")}
            aligned = spec["aligned"]
            key = [target, spec["qualname"], spec["signature"], constexprs, aligned, options]
            key = json.dumps(key, sort_keys=True)
            if key in done:
                continue
            done.add(key)
            kernel = _kernel(spec["module"], spec["qualname"])
            label = f"{target} {spec['qualname'].split('.')[-1]} {constexprs} {options}"
            attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
            try:
                source = ASTSource(fn=kernel, signature=spec["signature"], constexprs=constexprs, attrs=attrs)
                compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
                shared = compiled.metadata.shared
                limit = SHARED_LIMIT[target]
                if shared > limit:
                    raise RuntimeError(f"{shared} bytes of shared memory a program; the GPU allows {limit}")
                big = shared > SMALL_SHARED
                large += big
                print(f"OK   {label} shared {shared}{' (over 99 KiB)' if big else ''}", flush=True)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit code says it
                failures += 1
                print(f"FAIL {label}\n{exc}", flush=True)
    stale = set(GPU_CONSTEXPRS) - seen_overrides
    if stale:
        print(f"FAIL GPU_CONSTEXPRS names no recorded kernel's constexpr: {sorted(stale)}")
        failures += 1
    print(f"{len(done)} specializations compiled for {', '.join(TARGETS)}, {failures} failed")
    print(f"{large} of them hold more than 99 KiB of shared memory a program (Ada / A10-class GPUs allow no more)")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("record", "compile"):
        print(__doc__)
        sys.exit(2)
    sys.exit(record(sys.argv[2]) if sys.argv[1] == "record" else compile_all(sys.argv[2]))
