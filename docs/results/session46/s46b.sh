#!/bin/bash
# forty-sixth session: the GRPO step on real models' shapes (bench_ppo_step.py --hf-config), then the 1B baseline
S=$(( SECONDS - $(date +%s) + ${T0:-$(date +%s)} ))
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
A="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
for c in qwen3_0.6b llama3.2_1b base; do
  [ $((SECONDS-S)) -lt 330 ] || { echo "$c skipped"; continue; }
  H="--hf-config gpu_scratch/cfg/$c.json"; [ $c = base ] && H=""
  PYTHONPATH=. timeout 160 python3 scripts/bench_ppo_step.py $A $H --out $OUT/r/grpo_$c.json > $OUT/r/grpo_$c.log 2>&1
  echo "== $c rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|refit|step|rollout tokens|generated|peak)" $OUT/r/grpo_$c.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_$c.log
  tail -3 $OUT/r/grpo_$c.log | cut -c1-300
done
echo "done t=$((SECONDS-S))"
