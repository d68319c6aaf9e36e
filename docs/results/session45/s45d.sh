#!/bin/bash
# an H200: the generation goals only; else the GRPO step on real models' shapes (s45b.sh)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$name" in
  *H200*) echo "$name"; python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1; mkdir -p $OUT/r
    PYTHONPATH=. timeout 200 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/h200_bench.json > $OUT/r/h200_bench.log 2>&1; echo "bench rc=$?"; tail -7 $OUT/r/h200_bench.log;;
  *) bash gpu_scratch/s45b.sh;;
esac
