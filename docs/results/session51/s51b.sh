#!/bin/bash
# fifty-first session, call 2: the GRPO step on SmolLM3-3B's shape with less activation memory (call 1's micro-batches
# of 16 ran out of an H100's 80 GB: Adam's state of 3B parameters alone is ~36 GB); on an H200 first the goals'
# bench_generation at 64 / 256 rows (FP8 weights and cache) and the 1B GRPO step, not run on an H200 since the 31st.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1"; F="generation.decode_weights=fp8 generation.kv_dtype=fp8"
case "$name" in *H200*)
  for i in 1 2; do
    PYTHONPATH=. timeout 120 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/h200_bench$i.json > $OUT/r/h200_bench$i.log 2>&1; echo "bench rc=$? t=$((SECONDS-S))"; tail -5 $OUT/r/h200_bench$i.log | head -3
  done
  PYTHONPATH=. timeout 130 python3 scripts/bench_ppo_step.py $G --actor ppo.micro_batch_size=32 $F --out $OUT/r/h200_grpo.json > $OUT/r/h200_grpo.log 2>&1; echo "grpo 1b rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/h200_grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/h200_grpo.log;;
esac
PYTHONPATH=. timeout 200 python3 scripts/bench_ppo_step.py --hf-config gpu_scratch/cfg/smollm3_3b.json $G --actor ppo.micro_batch_size=4 ppo.forward_micro_batch_size=16 generation.release_kv_cache=true $F --out $OUT/r/grpo_smollm3.json > $OUT/r/grpo_smollm3.log 2>&1
echo "== grpo smollm3 rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo_smollm3.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_smollm3.log; tail -2 $OUT/r/grpo_smollm3.log | cut -c1-300
echo "done t=$((SECONDS-S))"
