"""The GRPO benchmark's reward function: a deterministic score in [0, 1) from each response's text (CRC-32).

Cheap and different within a group, so every group has a nonzero advantage and the update is a real one; what a
real verifier costs is not what the benchmark measures. Contract: aligner's reward functions (docs/REWARDS.md).
"""

import zlib


def reward_fn(prompts, responses):
    return [zlib.crc32(r.encode()) / 2**32 for r in responses]
