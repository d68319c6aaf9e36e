#!/bin/bash
# forty-seventh session, a nearly spent budget: on an H200 the goals (bench_generation at 64 / 256 rows, FP8 weights
# and cache; then the GRPO step while under 200 s); on another card tests/gpu/hf_families.py with the Phi-3 kinds
# (the image's numpy 2: only megatron-core and omegaconf from .whl)
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
mkdir -p $OUT/r
case "$name" in
*H200*)
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
  PYTHONPATH=. timeout 150 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/h200_bench.json > $OUT/r/h200_bench.log 2>&1; echo "bench rc=$? t=$((SECONDS-S))"; tail -7 $OUT/r/h200_bench.log
  if [ $((SECONDS-S)) -lt 200 ]; then
    A="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
    PYTHONPATH=. timeout 130 python3 scripts/bench_ppo_step.py $A --out $OUT/r/h200_grpo.json > $OUT/r/h200_grpo.log 2>&1; echo "grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/h200_grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/h200_grpo.log
  fi;;
*)
  python3 -m pip install -q --no-index --no-deps --no-compile .whl/megatron_core*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>&1 | tail -1
  PYTHONPATH=. timeout 150 python3 tests/gpu/hf_families.py --out $OUT/r/hf_families.json > $OUT/r/hf_families.log 2>&1
  rc=$?; echo "hf_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/hf_families.log | cut -c1-160; [ $rc -eq 0 ] || tail -5 $OUT/r/hf_families.log | cut -c1-300;;
esac
echo "done t=$((SECONDS-S))"
