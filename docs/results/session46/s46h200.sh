#!/bin/bash
# forty-sixth session (s37h200.sh without the repeats): the committed defaults on an H200 only (the goals' machine); on another card exit at once
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
case "$name" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -2
mkdir -p $OUT/r
PYTHONPATH=. timeout 150 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/h200_bench.json > $OUT/r/h200_bench.log 2>&1; echo "bench rc=$? t=$((SECONDS-S))"; tail -7 $OUT/r/h200_bench.log
A="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
PYTHONPATH=. timeout 150 python3 scripts/bench_ppo_step.py $A --out $OUT/r/h200_grpo.json > $OUT/r/h200_grpo.log 2>&1; echo "grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/h200_grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/h200_grpo.log
echo "done t=$((SECONDS-S))"
