#!/bin/bash
# fiftieth session, a nearly spent budget: the LongRoPE checks (hf_families, engine_families) on any card; on an H200 then only
# bench_generation at 64 / 256 rows (FP8 weights and cache), no GRPO step. Carry .whl (omegaconf 2.4.0), gpu_scratch.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/megatron_core*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 100 python3 tests/gpu/hf_families.py --kinds phi3 phi3_longrope phi4mini llama3 --out $OUT/r/hf_families.json > $OUT/r/hf_families.log 2>&1
rc=$?; echo "hf_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/hf_families.log | cut -c1-160; [ $rc -eq 0 ] || tail -5 $OUT/r/hf_families.log | cut -c1-300
PYTHONPATH=. timeout 180 python3 tests/gpu/engine_families.py --families phi3.5-style phi4-mini-style --out $OUT/r/engine_families.json > $OUT/r/engine_families.log 2>&1
rc=$?; echo "engine_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/engine_families.log | cut -c1-220; [ $rc -eq 0 ] || tail -5 $OUT/r/engine_families.log | cut -c1-300
case "$name" in *H200*)
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
  PYTHONPATH=. timeout 150 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/h200_bench.json > $OUT/r/h200_bench.log 2>&1; echo "bench rc=$? t=$((SECONDS-S))"; tail -7 $OUT/r/h200_bench.log;;
esac
echo "done t=$((SECONDS-S))"
