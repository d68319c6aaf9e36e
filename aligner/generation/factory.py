"""Choose the generation backend once, at construction; the PPO loop only sees `GenerationEngine`.

`build_engine(gen_cfg, model_cfg, policy)` must be called on every rank of the actor job (after
`aligner.parallel.initialize` and after the policy is built): each rank builds the engine over its own TP shard.
The TensorRT-LLM backend is imported only when asked for, so the rest of aligner never needs it.
"""

from __future__ import annotations

from aligner.config.generation import GenerationConfig, validate_generation
from aligner.generation.interfaces import GenerationEngine


def build_engine(gen_cfg: GenerationConfig, model_cfg, policy) -> GenerationEngine:
    validate_generation(gen_cfg, model_cfg)
    if gen_cfg.backend == "native":
        from aligner.generation.native import NativeEngine

        return NativeEngine(gen_cfg, model_cfg, policy)
    if gen_cfg.backend == "trtllm":
        from aligner.generation.trtllm import TrtllmEngine

        return TrtllmEngine(gen_cfg, model_cfg, policy)
    raise ValueError(f"generation.backend={gen_cfg.backend!r}: use native or trtllm")
