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
# while the other idles. Seconds per file from a full run's --durations=0 (b9f6a72), rounded; unlisted files are short
# and keep their order. A stale number only makes the order less good, never a test wrong.
FILE_SECONDS = {
    "functional/test_ppo_actor.py": 590,
    "functional/test_launch_slurm.py": 390,
    "functional/test_trainers.py": 340,
    "distributed/test_grpo_trainer.py": 245,
    "functional/test_grpo.py": 245,
    "functional/test_ppo_actor_layouts.py": 230,
    "distributed/test_model_parallel.py": 200,
    "unit/test_convert_scripts.py": 135,
    "functional/test_trainer_pipeline.py": 120,
    "functional/test_critic_demo.py": 155,
    "functional/test_generate.py": 110,
    "unit/test_generation_engine.py": 150,
    "functional/test_bench_ppo_step.py": 90,
    "functional/test_launch_actor_mpi.py": 90,
    "functional/test_walkthrough.py": 85,
    "distributed/test_generate_parallel.py": 85,
    "functional/test_actor_checkpoint_to_hf.py": 85,
    "unit/test_recompute.py": 80,
    "unit/test_sequence_parallel.py": 75,
    "distributed/test_generation_tp.py": 70,
    "functional/test_generation_bench.py": 60,
    "functional/test_critic_server.py": 55,
    "distributed/test_critic_job.py": 55,
    "distributed/test_trainers_parallel.py": 50,
    "distributed/test_convert_tp.py": 50,
    "functional/test_train_slurm.py": 45,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item):
        path = item.nodeid.split("::")[0]
        return FILE_SECONDS.get(path.removeprefix("tests/"), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: each file's tests stay together and in order
