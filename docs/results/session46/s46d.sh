#!/bin/bash
# forty-sixth session, the last minutes of the budget: an H200: the B=256 goal alone; another card: the GRPO step on
# Qwen3-0.6B's shape alone
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
case "$name" in
  *H200*) PYTHONPATH=. timeout 150 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 256 --out $OUT/r/h200_bench.json > $OUT/r/h200_bench.log 2>&1; echo "bench rc=$? t=$((SECONDS-S))"; tail -7 $OUT/r/h200_bench.log;;
  *) A="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
     PYTHONPATH=. timeout 160 python3 scripts/bench_ppo_step.py $A --hf-config gpu_scratch/cfg/qwen3_0.6b.json --out $OUT/r/grpo_qwen3_0.6b.json > $OUT/r/grpo_qwen3_0.6b.log 2>&1
     echo "== qwen3_0.6b rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|refit|step|rollout tokens|generated|peak)" $OUT/r/grpo_qwen3_0.6b.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_qwen3_0.6b.log; tail -3 $OUT/r/grpo_qwen3_0.6b.log | cut -c1-300;;
esac
