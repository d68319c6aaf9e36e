#!/bin/bash
# fifty-first session, call 3: torch's fused AdamW (optim.fused_adam) and the chunked finiteness check on a GPU:
# a resume (probe_resume.py: bit-identical?), the optimizer unit test on CUDA, the 1B GRPO step with fused_adam auto
# and off (same machine: step time, peak memory), then the GRPO step on SmolLM3-3B's shape on this card.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 90 python3 tests/gpu/probe_resume.py /tmp/probe_resume > $OUT/r/probe_resume.log 2>&1; echo "probe_resume rc=$? t=$((SECONDS-S))"; grep -E "^(deterministic|after load|grads|weights)" $OUT/r/probe_resume.log
PYTHONPATH=. timeout 60 python3 -m pytest -q -p no:cacheprovider tests/unit/test_optim_group_map.py > $OUT/r/pytest_optim.log 2>&1; echo "pytest optim rc=$? t=$((SECONDS-S))"; tail -1 $OUT/r/pytest_optim.log
G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1"; F="generation.decode_weights=fp8 generation.kv_dtype=fp8"
for f in auto off; do
  PYTHONPATH=. timeout 130 python3 scripts/bench_ppo_step.py $G --actor ppo.micro_batch_size=32 $F optim.fused_adam=$f --out $OUT/r/grpo_1b_$f.json > $OUT/r/grpo_1b_$f.log 2>&1; echo "== grpo 1b fused_adam=$f rc=$? t=$((SECONDS-S))"; grep -E "^\| (policy update|step|peak)" $OUT/r/grpo_1b_$f.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_1b_$f.log
done
PYTHONPATH=. timeout 200 python3 scripts/bench_ppo_step.py --hf-config gpu_scratch/cfg/smollm3_3b.json $G --actor ppo.micro_batch_size=4 ppo.forward_micro_batch_size=16 generation.release_kv_cache=true $F --out $OUT/r/grpo_smollm3.json > $OUT/r/grpo_smollm3.log 2>&1
echo "== grpo smollm3 rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo_smollm3.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_smollm3.log; tail -2 $OUT/r/grpo_smollm3.log | cut -c1-300
echo "done t=$((SECONDS-S))"
