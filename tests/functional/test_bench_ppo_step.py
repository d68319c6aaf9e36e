"""scripts/bench_ppo_step.py --tiny on CPU: both modes run the GPU benchmark's code paths end to end and write the
JSON the report reads; the HF mode imports no megatron, omegaconf or PyTriton (it must run under numpy 2 on the
GPU machine); the aligner mode refuses configs that do not describe the HF loop's workload; --report compares.
No assertion on speed."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "bench_ppo_step.py")
RESULT_KEYS = {
    "mode",
    "workload",
    "warmup_steps",
    "timed_steps",
    "phases_s",
    "step_s",
    "tokens_per_s",
    "generated_tokens_per_s",
    "per_step_s",
    "memory",
    "device",
    "versions",
}
# Any import of these raises ImportError in the HF run: the GPU image runs that mode without them.
BLOCK_HEAVY = (
    "import runpy, sys; [sys.modules.__setitem__(m, None) for m in ('megatron', 'omegaconf', 'pytriton')]; "
    "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _env():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    return env


def bench(*args, block_heavy=False, timeout=300):
    head = [sys.executable, "-c", BLOCK_HEAVY] if block_heavy else [sys.executable]
    return subprocess.run([*head, SCRIPT, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    hf = bench("--mode", "hf", "--tiny", "--steps", "2", "--out", str(tmp / "hf.json"), block_heavy=True)
    assert hf.returncode == 0, hf.stdout[-2000:] + hf.stderr[-4000:]
    # two ranks per job (DP=2 each, sharing the CPU), the layout that measured fastest on two GPUs (docs/PERF.md)
    run, out = ["--exp-dir", str(tmp / "run")], ["--out", str(tmp / "aligner.json")]
    al = bench("--mode", "aligner", "--tiny", "--steps", "2", "--actor-procs", "2", "--critic-procs", "2", *run, *out)
    assert al.returncode == 0, al.stdout[-2000:] + al.stderr[-4000:]
    return tmp


def _load(path):
    with open(path) as f:
        return json.load(f)


def _check_record(r, mode, phases):
    assert RESULT_KEYS <= set(r), RESULT_KEYS - set(r)
    assert r["mode"] == mode and r["warmup_steps"] == 1 and r["timed_steps"] == 1 and len(r["per_step_s"]) == 2
    assert set(phases) <= set(r["phases_s"]), r["phases_s"]
    assert all(v >= 0 for v in r["phases_s"].values())
    w = r["workload"]
    assert (w["num_layers"], w["hidden_size"], w["rollouts"], w["prompt_len"], w["response_len"]) == (2, 64, 8, 8, 8)
    assert r["step_s"] == pytest.approx(r["per_step_s"][1]["step"])
    assert r["tokens_per_s"] == pytest.approx(8 * 16 / r["step_s"])
    assert r["gpus"] == 0 and r["tokens_per_s_per_gpu"] is None, "no GPU occupied on the CPU"
    # the phases partition the step: their sum plus the unphased rest is the step
    assert sum(r["phases_s"].values()) == pytest.approx(r["step_s"], rel=1e-6)


def test_hf_mode_record(results):
    r = _load(results / "hf.json")
    _check_record(r, "hf", ("generate", "logprobs", "values_rewards", "advantages", "train", "critic_train"))
    assert r["checks"]["kl_step0"] == 0.0, "the reference starts as an exact copy of the policy"


def test_aligner_mode_record(results):
    r = _load(results / "aligner.json")
    _check_record(r, "aligner", ("generate", "logprobs", "critic_wait", "advantages", "train", "refit"))
    assert r["checks"]["kl_step0"] == 0.0, "policy and reference start identical"
    assert r["checks"]["response_length_mean"] == 8 and r["checks"]["ended_fraction_max"] == 0.0
    assert r["checks"]["logprob_mismatch_max"] < 1e-4
    with open(results / "run" / "prompts.jsonl") as f:
        assert all(len(json.loads(line)["prompt"].split()) == 7 for line in f), "7 words + BOS = 8 prompt tokens"
    assert os.path.exists(results / "run" / "actor" / "metrics.jsonl")
    assert (r["settings"]["actor_procs"], r["settings"]["critic_procs"]) == (2, 2)
    with open(results / "run" / "launcher.log") as f:
        launched = f.read()
    assert launched.count("--nproc-per-node 2") == 2, "both jobs started with two ranks"
    with open(results / "run" / "critic.log") as f:
        assert "DP 2" in f.read()


def test_report_compares(results):
    proc = bench("--report", str(results / "hf.json"), str(results / "aligner.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "speed-up per step:" in out and "| phase | HF loop (s) | aligner (s) |" in out
    hf, al = _load(results / "hf.json"), _load(results / "aligner.json")
    assert f"{hf['step_s'] / al['step_s']:.2f}x" in out
    for label in ("generate", "policy update", "critic update", "critic wait", "step"):
        assert f"| {label}" in out
    assert al["settings"]["actor_overrides"] == [] and "ran with overrides" not in out


def test_report_refuses_different_workloads(results, tmp_path):
    al = _load(results / "aligner.json")
    al["workload"]["response_len"] = 9
    (tmp_path / "other.json").write_text(json.dumps(al))
    proc = bench("--report", str(results / "hf.json"), str(tmp_path / "other.json"))
    assert proc.returncode == 2 and "not comparable" in proc.stdout and "workload.response_len" in proc.stdout
    proc = bench("--report", str(results / "aligner.json"), str(results / "hf.json"))
    assert proc.returncode == 2 and "order: hf, aligner" in proc.stdout


def test_aligner_config_must_match_workload(tmp_path):
    proc = bench(
        "--mode",
        "aligner",
        "--tiny",
        "--exp-dir",
        str(tmp_path / "run"),
        "--actor",
        "ppo.epochs=2",
        timeout=120,
    )
    assert proc.returncode == 2 and "ppo.epochs" in proc.stderr, proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run" / "launcher.log"), "nothing is launched"
    proc = bench(
        "--mode",
        "aligner",
        "--tiny",
        "--exp-dir",
        str(tmp_path / "run2"),
        "--critic",
        "reward_model.num_layers=3",
        timeout=120,
    )
    assert proc.returncode == 2 and "critic: reward_model.num_layers" in proc.stderr, proc.stderr[-2000:]


def test_full_configs_describe_the_full_workload(tmp_path):
    """conf/bench/ppo_step_{actor,critic}.yaml (the GPU run) match the HF loop's FULL workload as the jobs load them."""
    from benchmarks.ppo_step import aligner_jobs
    from benchmarks.ppo_step.workload import FULL

    tok, prompts = str(tmp_path / "tokenizer.json"), str(tmp_path / "prompts.jsonl")
    aligner_jobs.write_tokenizer(tok, FULL.vocab_size)
    aligner_jobs.write_prompts(prompts, 4, FULL.prompt_len - 1, FULL.vocab_size)
    actor = ["--config-name", "bench/ppo_step_actor", f"data.train_file={prompts}", f"model.tokenizer={tok}"]
    critic = ["--config-name", "bench/ppo_step_critic"]
    assert aligner_jobs.check_configs(FULL, actor, critic) == FULL
    with pytest.raises(aligner_jobs.WorkloadMismatch, match="generation.max_response_length"):
        aligner_jobs.check_configs(FULL, actor + ["generation.max_response_length=128"], critic)

    from aligner.data.prompts import PromptDataset
    from aligner.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tok)
    assert tokenizer.vocab_size == FULL.vocab_size and (tokenizer.pad_id, tokenizer.bos_id) == (0, 1)
    data = PromptDataset(prompts, tokenizer, FULL.prompt_len)
    assert [len(p.ids) for p in data.items] == [FULL.prompt_len] * 4 and data.items[0].ids[0] == tokenizer.bos_id


def test_sampling_ignore_eos_reaches_the_engine():
    from types import SimpleNamespace

    from aligner.config.actor import ActorJobConfig
    from aligner.generation import SamplingParams
    from aligner.ppo.trainer import PPOTrainer

    cfg = ActorJobConfig()
    for ignore, ends in ((False, [2]), (True, [])):
        cfg.sampling.ignore_eos = ignore
        kw = PPOTrainer._sampling_kw(SimpleNamespace(cfg=cfg))
        assert SamplingParams(**kw, eos_token_id=2).end_token_ids() == ends


def test_grpo_mode_tiny(tmp_path):
    """--mode grpo: the actor job alone (GRPO, 4 prompts x 2 samples, KL in the loss against the resident
    reference, a reward function), the phase table, KL 0 at step 0, the log-prob mismatch; a config that is not the
    workload is refused before anything starts."""
    out = tmp_path / "grpo.json"
    run = tmp_path / "run"
    proc = bench("--mode", "grpo", "--tiny", "--steps", "2", "--profile", "--exp-dir", str(run), "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = _load(out)
    # --profile: a third step under the profiler, left out of the two timed ones, its phase table printed
    assert len(r["per_step_s"]) == 2 and r["profile"]["step_s"]["train"] > 0
    assert {"generate", "logprobs", "train"} <= set(r["profile"]["summary"]["phases"])
    assert os.path.exists(run / "actor" / "profile" / "step2-rank0.json.gz") and "profiled step 2" in proc.stdout
    _check_record(r, "grpo", ("generate", "logprobs", "reward_wait", "advantages", "train", "refit"))
    assert r["workload"]["samples_per_prompt"] == 2
    # the header names the jobs' overrides (a micro-batch size the workload line would otherwise misstate)
    from benchmarks.ppo_step.report import render_single

    assert "ran with overrides" not in render_single(r)
    given = {**r, "settings": {**r["settings"], "actor_overrides": ["ppo.micro_batch_size=32"]}}
    assert render_single(given).splitlines()[1] == "grpo ran with overrides: actor ppo.micro_batch_size=32"
    c = r["checks"]
    assert c["kl_step0"] == 0.0 and c["logprob_mismatch_max"] < 1e-4 and c["kl_loss_last"] is not None
    assert c["response_length_mean"] == 8 and c["samples_per_step"] == 8
    assert "markdown for docs/PERF.md" in proc.stdout and "check kl_step0: 0.0" in proc.stdout
    bad = bench("--mode", "grpo", "--tiny", "--exp-dir", str(tmp_path / "bad"), "--actor", "ppo.kl.coef=0.1")
    assert bad.returncode == 2 and "ppo.kl.coef" in bad.stderr, bad.stderr[-2000:]
    assert not os.path.exists(tmp_path / "bad" / "launcher.log"), "nothing is launched"


# The workload fields _qwen3_config's shape decides, in the order the tests list its values.
QWEN3_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "vocab_size")


def _qwen3_config(path):
    from transformers import Qwen3Config

    hf = Qwen3Config(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=True, rope_theta=1e6,
        rms_norm_eps=1e-6,
    )  # fmt: skip
    hf.architectures = ["Qwen3ForCausalLM"]
    hf.save_pretrained(path)
    return path


def test_shape_overrides_give_a_job_config_the_hf_models_shape(tmp_path):
    """benchmarks.shapes.shape_overrides: loaded onto the GRPO benchmark's actor config, every key a checkpoint
    decides equals the converter's reading of the HF config (floats, null, booleans and names as OmegaConf reads
    them), for a Qwen3 (q/k norms, its own head width, tied) and a Llama 3.2 (llama3 RoPE scaling, no head_dim)."""
    from transformers import LlamaConfig

    from aligner.config.actor import load_actor_config
    from aligner.config.from_checkpoint import SHAPE_KEYS
    from benchmarks.ppo_step.aligner_jobs import write_prompts, write_tokenizer
    from benchmarks.shapes import model_from_hf_config, shape_overrides

    llama = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=500, rope_theta=5e5, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    )  # fmt: skip
    llama.architectures = ["LlamaForCausalLM"]
    llama.save_pretrained(tmp_path / "llama")
    tokenizer, prompts = tmp_path / "tokenizer.json", tmp_path / "prompts.jsonl"
    write_tokenizer(str(tokenizer), 300)
    write_prompts(str(prompts), 4, 7, 300)
    paths = [f"model.tokenizer={tokenizer}", f"data.train_file={prompts}"]
    for path in (_qwen3_config(tmp_path / "qwen3"), tmp_path / "llama"):
        model = model_from_hf_config(str(path))
        cfg = load_actor_config(["--config-name", "bench/grpo_step_actor_tiny", *paths, *shape_overrides(model)])
        assert {k: getattr(cfg.model, k) for k in SHAPE_KEYS} == {k: getattr(model, k) for k in SHAPE_KEYS}
        assert cfg.model.params_dtype == "float32", "the shape only: the config's own dtype stays"
    assert (model.rope_scaling, model.rope_scaling_factor, model.head_dim) == ("llama3", 32.0, None)


def test_a_sliding_window_caps_the_benchmarks_positions(tmp_path):
    """A Phi-3 mini 4k-style config (a window on every layer, shorter than the context; fused qkv / gate_up names) is
    read with its positions capped at the window, as the converter's --max-position-embeddings caps them, instead of
    being refused; its shape loads onto the GRPO actor config."""
    from transformers import Phi3Config

    from aligner.config.actor import load_actor_config
    from aligner.config.from_checkpoint import SHAPE_KEYS
    from benchmarks.ppo_step.aligner_jobs import write_prompts, write_tokenizer
    from benchmarks.shapes import model_from_hf_config, shape_overrides

    hf = Phi3Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=64, sliding_window=47, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    hf.architectures = ["Phi3ForCausalLM"]
    hf.save_pretrained(tmp_path / "phi3")
    model = model_from_hf_config(str(tmp_path / "phi3"))
    assert (model.arch, model.max_position_embeddings, model.ffn_hidden_size) == ("phi3", 47, 96)
    tokenizer, prompts = tmp_path / "tokenizer.json", tmp_path / "prompts.jsonl"
    write_tokenizer(str(tokenizer), 300)
    write_prompts(str(prompts), 4, 7, 300)
    paths = [f"model.tokenizer={tokenizer}", f"data.train_file={prompts}"]
    cfg = load_actor_config(["--config-name", "bench/grpo_step_actor_tiny", *paths, *shape_overrides(model)])
    assert {k: getattr(cfg.model, k) for k in SHAPE_KEYS} == {k: getattr(model, k) for k in SHAPE_KEYS}
    # Phi-3.5-style LongRoPE: capped at its pre-training context (64 of 256 positions), its factor lists carried over
    pairs = 8
    longrope = {"rope_type": "longrope", "short_factor": [1.0 + i for i in range(pairs)], "long_factor": [9.0] * pairs}
    hf = Phi3Config(**{**hf.to_dict(), "max_position_embeddings": 256, "sliding_window": None})
    hf.original_max_position_embeddings, hf.rope_parameters = 64, {**hf.rope_parameters, **longrope}
    hf.rope_parameters["original_max_position_embeddings"] = 64
    hf.save_pretrained(tmp_path / "phi35")
    model = model_from_hf_config(str(tmp_path / "phi35"))
    assert (model.rope_scaling, model.max_position_embeddings, model.rope_scaling_short_factor[-1]) == (
        "longrope",
        64,
        8,
    )
    cfg = load_actor_config(["--config-name", "bench/grpo_step_actor_tiny", *paths, *shape_overrides(model)])
    assert {k: getattr(cfg.model, k) for k in SHAPE_KEYS} == {k: getattr(model, k) for k in SHAPE_KEYS}


def test_grpo_mode_on_a_hf_configs_shape(tmp_path):
    """--hf-config: the GRPO step on a team's own model's shape from its config.json alone (random weights): a
    Qwen3-style model (q/k norms, its own head width, tied embeddings) runs end to end (KL 0 at step 0, the engine's
    log-probs = the training forward's), the record and its header name the config; a bad config and the HF loop's
    mode are one line each, exit 2."""
    qwen3 = str(_qwen3_config(tmp_path / "qwen3"))
    out, run = tmp_path / "grpo.json", tmp_path / "run"
    proc = bench(
        "--mode", "grpo", "--tiny", "--steps", "2", "--hf-config", qwen3, "--exp-dir", str(run), "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = _load(out)
    w = r["workload"]
    assert tuple(w[k] for k in QWEN3_SHAPE) == (2, 48, 4, 2, 80, 300) and w["dtype"] == "float32"
    assert r["settings"]["hf_config"] == qwen3 and r["settings"]["actor_overrides"] == []
    assert f"generated tokens), the shape of {qwen3}: 2 layers, hidden 48," in proc.stdout
    assert "ran with overrides" not in proc.stdout, "the shape is the workload line's, not a user's override"
    command = (run / "launcher.log").read_text().splitlines()[0]
    assert all(
        key in command.split() for key in ("model.qk_layernorm=true", "model.head_dim=16", "model.tie_embeddings=true")
    )
    c = r["checks"]
    assert c["kl_step0"] == 0.0 and c["logprob_mismatch_max"] < 1e-4 and c["response_length_mean"] == 8

    (tmp_path / "bad.json").write_text("{not json")
    cases = [
        (["--mode", "grpo", "--tiny", "--hf-config", str(tmp_path / "none")], "give config.json or the directory"),
        (["--mode", "grpo", "--tiny", "--hf-config", str(tmp_path / "bad.json")], "is not JSON"),
        (["--mode", "hf", "--tiny", "--hf-config", qwen3], "--hf-config times aligner's jobs"),
        (["--mode", "aligner", "--tiny", "--hf-config", str(tmp_path / "bad.json")], "is not JSON"),
    ]
    for argv, words in cases:
        proc = bench(*argv, "--exp-dir", str(tmp_path / "refused"))
        assert proc.returncode == 2 and words in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "refused"), "nothing is written"


def test_ppo_mode_on_a_hf_configs_shape(tmp_path, results):
    """--mode aligner --hf-config: the PPO step's two jobs on a team's own model's shape, the critic's value model and
    reward model in the policy's shape too (q/k norms, head width, tied embeddings reach all three); KL 0 at step 0
    and the engine's log-probs = the training forward's; the record names the config, and --report refuses to set
    it against the HF loop's 1B workload."""
    qwen3 = str(_qwen3_config(tmp_path / "qwen3"))
    out, run = tmp_path / "ppo.json", tmp_path / "run"
    proc = bench(
        "--mode", "aligner", "--tiny", "--steps", "2", "--hf-config", qwen3, "--exp-dir", str(run), "--out", str(out)
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = _load(out)
    w = r["workload"]
    assert tuple(w[k] for k in QWEN3_SHAPE) == (2, 48, 4, 2, 80, 300) and w["rollouts"] == 8
    assert r["settings"]["hf_config"] == qwen3 and r["settings"]["critic_overrides"] == []
    assert f"generated tokens), the shape of {qwen3}: 2 layers, hidden 48," in proc.stdout
    started = {
        line.split()[1]: set(line.split())
        for line in (run / "launcher.log").read_text().splitlines()
        if " job: " in line
    }
    assert set(started) == {"actor", "critic"}, started.keys()
    for job, words in started.items():
        assert {"model.qk_layernorm=true", "model.head_dim=16", "model.tie_embeddings=true"} <= words, job
    assert {"reward_model.qk_layernorm=true", "reward_model.vocab_size=300"} <= started["critic"]
    c = r["checks"]
    assert c["kl_step0"] == 0.0 and c["logprob_mismatch_max"] < 1e-4 and c["response_length_mean"] == 8
    proc = bench("--report", str(results / "hf.json"), str(out))
    assert proc.returncode == 2 and "not comparable" in proc.stdout and "workload.hidden_size" in proc.stdout


def test_gpus_used_counts_the_union_of_the_jobs_devices():
    from benchmarks.ppo_step.workload import gpus_used

    assert gpus_used(2, "0", "1") == 2  # the two-GPU mode
    assert gpus_used(2, "0,1", "1") == 2  # a critic sharing one of the actor's GPUs
    assert gpus_used(2, "0") == 1
    assert gpus_used(2, None, None) == 1 and gpus_used(0, None) == 0  # default device; the CPU
