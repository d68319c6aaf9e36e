"""TensorRT-LLM backend (optional; `tensorrt_llm` is imported only when an engine is built). See engine.py."""

from aligner.generation.trtllm.engine import TrtllmEngine, trtllm_llama_weights

__all__ = ["TrtllmEngine", "trtllm_llama_weights"]
