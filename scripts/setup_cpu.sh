#!/usr/bin/env bash
# One-command CPU set-up: a virtual environment in .venv with the CPU build of PyTorch, then aligner and its test
# extras (megatron-core, PyTriton with numpy<2, mpi4py + the mpich wheel, ...). GPU clusters bring their own CUDA
# torch (e.g. an NGC container) and run `pip install -e .` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[test]"
# Triton for its interpreter: the tests run the engine's Triton kernels on the CPU (TRITON_INTERPRET=1). The CPU
# torch wheel does not bring it; a CUDA torch brings its own (never pin it there).
.venv/bin/python -m pip install -q "triton==${TRITON_VERSION:-3.6.0}"
.venv/bin/python -c "import torch, megatron.core, pytriton, triton; print('aligner set up: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
