import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and other helpers
# benchmarks/ is repo tooling, not installed with aligner; appended so `aligner` still resolves as before.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# Triton kernels (generation.decode_attention=triton) run on the CPU under Triton's interpreter; it must be on
# before anything imports triton (its own library functions are defined at import).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Each pytest worker (and what it starts) draws free ports from its own part of the pool, so that two workers never
# draw the same port in the seconds before either binds it (aligner/utils/net.py).
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ.setdefault(
        "ALIGNER_PORT_SLICE", f"{int(os.environ['PYTEST_XDIST_WORKER'][2:])}/{os.environ['PYTEST_XDIST_WORKER_COUNT']}"
    )
# aligner before any test module imports megatron-core: megatron's fusions are then compiled on their first call,
# not at import (aligner/lazy_fusions.py), in the pytest workers too
import aligner  # noqa: E402, F401

# The order in which the two pytest workers take test files (scripts/test.sh: --dist loadfile
# --no-loadscope-reorder): the longest files first, so that a run does not end with one worker alone on a long file
# while the other idles. Seconds per file from a full run's --durations=0 (e1352d1, on a slow day; less what the
# fifty-second session cut), rounded; unlisted files are short and keep their order. A stale number only makes the
# order less good, never a test wrong.
FILE_SECONDS = {
    "functional/test_launch_slurm.py": 450,
    "functional/test_ppo_actor.py": 420,
    "functional/test_trainers.py": 400,
    "unit/test_generation_engine.py": 350,
    "functional/test_ppo_actor_layouts.py": 330,
    "distributed/test_grpo_trainer.py": 320,
    "functional/test_grpo.py": 220,
    "functional/test_generate.py": 210,
    "functional/test_bench_ppo_step.py": 180,
    "distributed/test_model_parallel.py": 170,
    "functional/test_trainer_pipeline.py": 160,
    "unit/test_convert_scripts.py": 150,
    "distributed/test_generate_parallel.py": 140,
    "unit/test_triton_sm90.py": 130,
    "unit/test_triton_decode.py": 130,
    "unit/test_probe_attention_candidates.py": 130,
    "functional/test_walkthrough.py": 130,
    "functional/test_generation_bench.py": 120,
    "functional/test_critic_demo.py": 110,
    "functional/test_launch_actor_mpi.py": 110,
    "functional/test_actor_checkpoint_to_hf.py": 100,
    "distributed/test_generation_tp.py": 100,
    "unit/test_probe_attention_code.py": 100,
    "functional/test_train_slurm.py": 80,
    "unit/test_packing.py": 70,
    "distributed/test_convert_tp.py": 70,
    "unit/test_recompute.py": 60,
    "unit/test_sequence_parallel.py": 60,
    "distributed/test_trainers_parallel.py": 60,
    "functional/test_critic_server.py": 50,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item):
        path = item.nodeid.split("::")[0]
        return FILE_SECONDS.get(path.removeprefix("tests/"), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: each file's tests stay together and in order
