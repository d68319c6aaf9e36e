"""scripts/bench_generation.py --tiny runs end to end on CPU (the GPU benchmark's code path, small), and its numeric
checks hold: HF generate on the converted weights decodes the same greedy tokens as the native engine, and the
engine's log-probs equal megatron's forward. No assertion on speed."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_script(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """scripts/bench_generation.py as a process, its output captured."""
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench_generation.py"), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _bench_generation(*args: str, **env_extra: str) -> subprocess.CompletedProcess:
    """scripts/bench_generation.py on the CPU (a free port, no GPU); asserts it exited 0."""
    from dist import free_port

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MASTER_PORT": str(free_port()), **env_extra}
    env.pop("RANK", None)
    proc = _run_script(*args, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_bench_generation_tiny(tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench_generation("--tiny", "--batch-sizes", "3", "--profile", "--profile-kernels", "4", "--out", str(out))
    assert "native tok/s" in proc.stdout
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["batch"] == 3 and row["native_greedy_tok_s"] > 0 and row["hf_static_tok_s"] > 0
    assert row["hf_vs_megatron_logit_maxdiff"] < 1e-4
    assert row["hf_static_common_prefix_frac"] == 1.0 and row["hf_dynamic_common_prefix_frac"] == 1.0
    assert row["logp_abs_diff_max"] < 1e-4
    assert report["refit_ms"] > 0 and report["copy_bandwidth_GBps"] > 0
    prof = report["profile"]
    assert len(prof["kernels"]) == 4 and abs(sum(k["share"] for k in prof["by_kind"].values()) - 1) < 1e-6
    assert "by kind:" in proc.stdout


def test_bench_generation_ragged_prompts_triton(tmp_path):
    """Prompts of mixed lengths (--ragged), each in two neighbouring rows (--samples-per-prompt: prefilled once),
    through the Triton decode attention (Triton's interpreter here): the engine's log-probs still equal megatron's
    forward on each sample's own prompt and response. A batch that is not whole groups: one line, exit 2."""
    out = tmp_path / "bench.json"
    args = ["--tiny", "--skip-hf", "--ragged", "--batch-sizes", "4", "--decode-attention", "triton", "--out", str(out)]
    _bench_generation(*args, "--samples-per-prompt", "2", TRITON_INTERPRET="1")
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["ragged"] and report["decode_attention"] == "triton" and report["samples_per_prompt"] == 2
    assert row["prompt_tokens_mean"] < report["prompt_len"] and row["logp_abs_diff_max"] < 1e-4
    proc = _run_script("--tiny", "--batch-sizes", "4", "6", "--samples-per-prompt", "4")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "bench_generation: --samples-per-prompt 4 must divide every batch size"
    ]


def test_bench_model_presets():
    """--preset picks benchmarks/shapes.py's shapes (1b the default, the goals' model; 8b issue 12's); --tiny is a model
    of its own, so both together are one line, exit 2."""
    from benchmarks.generation import BENCH_MODEL, TINY_MODEL, bench_model
    from benchmarks.shapes import PRESETS

    assert bench_model() == BENCH_MODEL and bench_model("tiny") is TINY_MODEL
    for name in ("1b", "8b"):
        cfg = bench_model(name)
        assert cfg.arch == "llama" and cfg.params_dtype == "bfloat16"
        assert {k: getattr(cfg, k) for k in PRESETS[name]} == PRESETS[name]
    assert (BENCH_MODEL.num_layers, BENCH_MODEL.hidden_size, BENCH_MODEL.ffn_hidden_size) == (16, 2048, 8192)
    assert (bench_model("8b").num_layers, bench_model("8b").hidden_size) == (32, 4096)
    proc = _run_script("--tiny", "--preset", "8b")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "bench_generation: --tiny, --preset and --hf-config each name the model: give one"
    ]


def test_bench_generation_on_a_hf_configs_shape(tmp_path):
    """--hf-config times the engine on a team's own model's shape from its config.json alone (random weights): a
    Qwen3-style model (q/k norms, its own head width) runs end to end with the engine's log-probs = megatron's; a
    sequence classifier, a missing file and the HF comparison asked for are each one line, exit 2."""
    from transformers import Qwen3Config

    hf = Qwen3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    hf.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(tmp_path / "qwen3")
    out = tmp_path / "bench.json"
    args = ["--skip-hf", "--batch-sizes", "2", "--prompt-len", "8", "--new-tokens", "4", "--out", str(out)]
    _bench_generation("--hf-config", str(tmp_path / "qwen3"), *args)
    report = json.loads(out.read_text())
    assert report["hf_config"] == str(tmp_path / "qwen3") and report["preset"] is None
    model = report["model"]
    assert (model["num_layers"], model["hidden_size"], model["ffn_hidden_size"], model["vocab_size"]) == (
        2,
        64,
        96,
        128,
    )
    assert (model["num_attention_heads"], model["num_query_groups"], model["params_dtype"]) == (4, 2, "bfloat16")
    (row,) = report["rows"]
    assert row["native_greedy_tok_s"] > 0 and row["logp_abs_diff_max"] < 0.1

    hf.architectures = ["Qwen3ForSequenceClassification"]
    hf.num_labels = 1
    hf.save_pretrained(tmp_path / "rm")
    cases = [
        (["--hf-config", str(tmp_path / "rm" / "config.json"), "--skip-hf"], "describes a reward model"),
        (["--hf-config", str(tmp_path / "none"), "--skip-hf"], "give config.json or the directory holding it"),
        (["--hf-config", str(tmp_path / "qwen3")], "--hf-config times the native engine only: add --skip-hf"),
    ]
    for argv, words in cases:
        proc = _run_script(*argv)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and words in lines[0], proc.stderr[-2000:]


def test_profile_kinds_from_kernel_names():
    """Names as the H200 profiles printed them (docs/PERF.md) land in the kind a reader expects."""
    from benchmarks.profiling import kind_of

    assert kind_of("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kind_of("nvjet_tst_128x64_64x8_2x1_v_bz_badd_TNT") == "attention"  # scores over the KV cache
    assert kind_of("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kind_of("triton_red_fused__fused_rms_norm_add_0") == "norm"
    assert kind_of("decode_attention_fwd") == kind_of("decode_attention_merge") == "attention"  # our Triton kernels
    assert kind_of("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>") == "copy/cast"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>") == (
        "other elementwise"
    )


def test_bench_decode_kernels_says_it_needs_a_gpu():
    """The kernel benchmark times CUDA graphs: on a CPU it exits 2 with one line saying so (and what to run here)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "bench_decode_kernels.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "bench_decode_kernels: needs a CUDA GPU: the kernels are timed inside CUDA graphs "
        "(bench_generation.py --tiny is the CPU smoke run)"
    ]
