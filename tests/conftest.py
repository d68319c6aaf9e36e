import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and other helpers
# benchmarks/ is repo tooling, not installed with aligner; appended so `aligner` still resolves as before.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
# Triton kernels (generation.decode_attention=triton) run on the CPU under Triton's interpreter; it must be on
# before anything imports triton (its own library functions are defined at import).
os.environ.setdefault("TRITON_INTERPRET", "1")
