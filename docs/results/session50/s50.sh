#!/bin/bash
# fiftieth session: LongRoPE (Phi-3.5, Phi-4-mini's over 3/4 of the head) on a GPU: tests/gpu/hf_families.py (ours against HF's own forward) and
# tests/gpu/engine_families.py (the engine's GPU paths against megatron's forward) with the Phi-3.5 kinds, on any card
# (the image's numpy 2: only megatron-core and omegaconf from .whl); then on an H200 the goals (s46h200.sh installs
# every wheel). Carry .whl (omegaconf 2.4.0) and gpu_scratch.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/megatron_core*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 120 python3 tests/gpu/hf_families.py --kinds phi3 phi3_longrope phi4mini llama3 --out $OUT/r/hf_families.json > $OUT/r/hf_families.log 2>&1
rc=$?; echo "hf_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/hf_families.log | cut -c1-160; [ $rc -eq 0 ] || tail -5 $OUT/r/hf_families.log | cut -c1-300
PYTHONPATH=. timeout 200 python3 tests/gpu/engine_families.py --families phi3.5-style phi4-mini-style llama3.2-style --out $OUT/r/engine_families.json > $OUT/r/engine_families.log 2>&1
rc=$?; echo "engine_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/engine_families.log | cut -c1-220; [ $rc -eq 0 ] || tail -5 $OUT/r/engine_families.log | cut -c1-300
case "$name" in *H200*) bash gpu_scratch/s46h200.sh;; esac
echo "done t=$((SECONDS-S))"
