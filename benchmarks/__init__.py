"""Benchmarks of aligner: repo tooling beside scripts/, not part of the library.

setup.py ships `aligner` only and nothing under aligner/ imports this package; the thin entry points
scripts/bench_*.py put the checkout's root on sys.path and call in here.
- `ppo_step/`: one PPO step, aligner's two jobs against a plain HF transformers loop (scripts/bench_ppo_step.py).
- `generation.py`: the native generation engine against HF transformers `generate` (scripts/bench_generation.py).
- `model.py`: forward+backward of the megatron GPT model per attention backend, MFU (scripts/bench_model.py).
- `checkpoint_writer.py`: first saves with and without megatron's writer helper (scripts/bench_checkpoint_writer.py).
"""
