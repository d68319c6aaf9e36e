"""The native engine: megatron's GPT maths over its own weight buffers and a preallocated KV cache (see engine.py)."""

from aligner.generation.native.engine import NativeEngine

__all__ = ["NativeEngine"]
