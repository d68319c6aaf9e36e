#!/bin/bash
# prepared in the forty-fourth session (any GPU; on an H200 the goals first, s37h200.sh): QK_NORM against off on
# Qwen3-8B's shape (FP8 weights and cache, then bf16) and Qwen3-0.6B's in bf16; train_families at its defaults
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
case "$name" in *H200*) bash gpu_scratch/s37h200.sh;; esac
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r; F=aligner/generation/native/triton_decode.py; cp $F /tmp/td_new.py
use() { if [ $1 = old ]; then sed 's/^QK_NORM = True/QK_NORM = False/' /tmp/td_new.py > $F; else cp /tmp/td_new.py $F; fi; }
for v in "new fp8 qwen3_8b" "old fp8 qwen3_8b" "new bf16 qwen3_8b" "old bf16 qwen3_8b" "new bf16 qwen3_0.6b" "old bf16 qwen3_0.6b"; do
  set -- $v; [ $((SECONDS-S)) -lt 420 ] || { echo "$v skipped"; continue; }
  use $1; W=""; [ $2 = fp8 ] && W="--decode-weights fp8 --kv-dtype fp8"
  PYTHONPATH=. timeout 100 python3 scripts/bench_generation.py --skip-hf --hf-config gpu_scratch/cfg/$3.json $W --batch-sizes 64 256 --out $OUT/r/q_$1_$2_$3.json > $OUT/r/q.log 2>&1
  echo "$v rc=$? t=$((SECONDS-S))"; grep -E "^ *(64|256) " $OUT/r/q.log | cut -c1-130
done
use new
[ $((SECONDS-S)) -lt 500 ] && { PYTHONPATH=. timeout 80 python3 tests/gpu/train_families.py --out $OUT/r/tf.json > $OUT/r/tf.log 2>&1; echo "train_families rc=$? t=$((SECONDS-S))"; grep -E "^\| " $OUT/r/tf.log; }
echo "done t=$((SECONDS-S))"
