#!/bin/bash
# fifty-fourth session, call 4 (an H200, fresh): the GRPO step with FP8 rollouts (s52b.sh's GRPO part), the first on
# an H200 since the thirty-first session; no critic job, so .whl-min (megatron-core, omegaconf) is all it needs.
S=$SECONDS; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl-min/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
PYTHONPATH=. timeout 300 python3 scripts/bench_ppo_step.py $G --out $OUT/r/grpo.json > $OUT/r/grpo.log 2>&1
echo "== grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo.log; tail -2 $OUT/r/grpo.log | cut -c1-300
