"""GPU probe (by hand, 2 GPUs; not collected by pytest): why a TP=2 actor hangs in destroy_process_group.

    torchrun --nproc_per_node 2 tests/gpu/probe_shutdown.py VARIANT
VARIANT: asis (engine with CUDA graphs, then shutdown), nographs (engine without graphs), release (drop the
engine's graphs and synchronize before shutdown), barrier (synchronize + barrier before shutdown), timeout (rank 1
skips a TP all-reduce: how NCCL's watchdog reports it, and that the phase watchdog ends the job: run it under
`time torchrun ...; echo $?`, expect a non-zero status about 30 s in). Prints one line per rank: VARIANT rank
seconds outcome. A watchdog thread dumps the stacks and exits 3 if shutdown takes more than 40 s.
"""

import faulthandler
import os
import sys
import threading
import time

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main(variant: str) -> None:
    from aligner.config import ModelConfig
    from aligner.generation import GenerationConfig, SamplingParams, build_engine
    from aligner.models.training import TrainableModel
    from aligner.parallel import initialize, shutdown

    initialize(tensor_parallel=2, timeout_minutes=0.5 if variant == "timeout" else 30)
    rank = torch.distributed.get_rank()
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=512,
        ffn_hidden_size=512,
        params_dtype="bfloat16",
    )
    policy = TrainableModel(cfg, __import__("aligner.config", fromlist=["OptimConfig"]).OptimConfig())
    gen = GenerationConfig(
        max_batch_size=4, max_prompt_length=8, max_response_length=8, cuda_graphs=variant != "nographs"
    )
    engine = build_engine(gen, cfg, policy.module)
    prompts = torch.randint(0, 512, (4, 8), device=DEV)
    lengths = torch.full((4,), 8, dtype=torch.long, device=DEV)
    out = engine.generate(prompts, lengths, SamplingParams(greedy=True, ignore_eos=True))
    sync()
    print(
        f"{variant} rank {rank} generated {tuple(out.response_tokens_BR.shape)} graphs="
        f"{getattr(engine, 'num_graphs', '?')}",
        flush=True,
    )
    if variant == "timeout":
        from megatron.core import parallel_state as ps

        from aligner.parallel.watchdog import PhaseWatchdog

        # As in the trainers: each phase watched with the process group's own timeout (30 s here); the job must end
        # with a non-zero exit code soon after, naming rank and phase, whatever NCCL's watchdog does.
        watchdog = PhaseWatchdog(30, lambda: f"rank {rank}:")
        t0 = time.monotonic()
        x = torch.ones(1, device=DEV)
        try:
            if rank == 0:
                with watchdog.phase("probe all-reduce"):
                    torch.distributed.all_reduce(x, group=ps.get_tensor_model_parallel_group())
                    sync()
            else:
                time.sleep(150)
            print(f"timeout rank {rank} {time.monotonic() - t0:.1f}s no error", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(
                f"timeout rank {rank} {time.monotonic() - t0:.1f}s raised {type(exc).__name__}: {exc}"[:600], flush=True
            )
        os._exit(0)
    if variant == "release":
        engine._graphs.clear()
        del engine
        import gc

        gc.collect()
        sync()
    if variant == "barrier":
        sync()
        torch.distributed.barrier()

    def watchdog():
        time.sleep(40)
        print(f"{variant} rank {rank} HANG in shutdown; stacks:", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.monotonic()
    shutdown()
    print(f"{variant} rank {rank} shutdown {time.monotonic() - t0:.2f}s ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
