import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # tests/dist.py and other helpers
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
