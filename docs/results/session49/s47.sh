#!/bin/bash
# forty-seventh session: tests/gpu/hf_families.py with the Phi-3 kinds (the image's numpy 2: only megatron-core and
# omegaconf from .whl), then on an H200 the goals (s46h200.sh installs every wheel)
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl/megatron_core*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 150 python3 tests/gpu/hf_families.py --out $OUT/r/hf_families.json > $OUT/r/hf_families.log 2>&1
echo "hf_families rc=$? t=$((SECONDS-S))"; grep -E "^(PASS|FAIL)|^\|" $OUT/r/hf_families.log | cut -c1-160 | tail -16
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$name" in *H200*) bash gpu_scratch/s46h200.sh;; esac
echo "done t=$((SECONDS-S))"
