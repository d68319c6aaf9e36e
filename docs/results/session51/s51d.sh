#!/bin/bash
# fifty-first session, call 4: optim.fused_adam=off against auto on the same machine (call 3's off run had failed on
# the YAML 1.1 reading of 'off', fixed in 1064892): the 1B GRPO step off then auto, then SmolLM3-3B's shape off.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1"; F="generation.decode_weights=fp8 generation.kv_dtype=fp8"
for f in off auto; do
  PYTHONPATH=. timeout 130 python3 scripts/bench_ppo_step.py $G --actor ppo.micro_batch_size=32 $F optim.fused_adam=$f --out $OUT/r/grpo_1b_$f.json > $OUT/r/grpo_1b_$f.log 2>&1; echo "== grpo 1b fused_adam=$f rc=$? t=$((SECONDS-S))"; grep -E "^\| (policy update|step|peak)" $OUT/r/grpo_1b_$f.log; tail -1 $OUT/r/grpo_1b_$f.log | cut -c1-200
done
PYTHONPATH=. timeout 200 python3 scripts/bench_ppo_step.py --hf-config gpu_scratch/cfg/smollm3_3b.json $G --actor ppo.micro_batch_size=4 ppo.forward_micro_batch_size=16 generation.release_kv_cache=true $F optim.fused_adam=off --out $OUT/r/grpo_smollm3_off.json > $OUT/r/grpo_smollm3_off.log 2>&1
echo "== grpo smollm3 fused_adam=off rc=$? t=$((SECONDS-S))"; grep -E "^\| (policy update|step|peak)" $OUT/r/grpo_smollm3_off.log; grep -E "out of GPU memory" $OUT/r/grpo_smollm3_off.log | head -1 | cut -c1-250
echo "done t=$((SECONDS-S))"
