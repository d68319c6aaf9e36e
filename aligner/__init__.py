"""aligner: Megatron-native RLHF (PPO, GRPO and the supervised trainers). Importing the package imports nothing
heavy; it only defers megatron-core's fused functions' torch.compile to their first call (aligner/lazy_fusions.py)."""

from aligner import lazy_fusions

lazy_fusions.install()
