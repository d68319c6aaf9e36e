"""Rollout generation: a small engine interface, its config section, and the backend factory.

`build_engine(gen_cfg, model_cfg, policy)` -> an engine with `generate(prompt_tokens_BT, prompt_lengths_B,
sampling)` and `refit(policy)` (see interfaces.py for the contract). Backends: native/ (ours, always available),
trtllm/ (TensorRT-LLM, imported lazily where installed).
"""

from aligner.config.generation import GenerationConfig, validate_generation
from aligner.generation.factory import build_engine
from aligner.generation.interfaces import (
    GenerationEngine,
    GenerationOutput,
    ReleasableMemory,
    SamplingParams,
)

__all__ = [
    "GenerationConfig",
    "GenerationEngine",
    "GenerationOutput",
    "ReleasableMemory",
    "SamplingParams",
    "build_engine",
    "validate_generation",
]
