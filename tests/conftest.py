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
# while the other idles. Seconds per file from a full run's --junitxml (e580e71, ranks forked from tests/dist.py's
# preloaded server), rounded; unlisted files are short and keep their order. A stale number only makes the
# order less good, never a test wrong.
FILE_SECONDS = {
    "functional/test_launch_slurm.py": 380,
    "functional/test_ppo_actor.py": 380,
    "unit/test_generation_engine.py": 350,
    "functional/test_trainers.py": 240,
    "functional/test_ppo_actor_layouts.py": 200,
    "functional/test_grpo.py": 170,
    "functional/test_bench_ppo_step.py": 150,
    "functional/test_generate.py": 140,
    "functional/test_critic_demo.py": 120,
    "unit/test_triton_sm90.py": 110,
    "functional/test_generation_bench.py": 110,
    "unit/test_triton_decode.py": 90,
    "functional/test_launch_actor_mpi.py": 90,
    "unit/test_convert_scripts.py": 90,
    "functional/test_trainer_pipeline.py": 90,
    "unit/test_probe_attention_candidates.py": 90,
    "unit/test_probe_attention_code.py": 80,
    "distributed/test_generate_parallel.py": 80,
    "functional/test_walkthrough.py": 70,
    "functional/test_actor_checkpoint_to_hf.py": 50,
    "distributed/test_grpo_trainer.py": 40,
    "functional/test_train_slurm.py": 30,
    "unit/test_generation_fp8.py": 30,
    "functional/test_critic_server.py": 30,
    "distributed/test_generation_tp.py": 30,
    "distributed/test_critic_job.py": 30,
    "distributed/test_convert_tp.py": 30,
}


def pytest_collection_modifyitems(config, items):
    def seconds(item):
        path = item.nodeid.split("::")[0]
        return FILE_SECONDS.get(path.removeprefix("tests/"), 0)

    items.sort(key=lambda item: -seconds(item))  # stable: each file's tests stay together and in order
