#!/bin/bash
# fifty-second session, compact: the PPO step with both jobs on the one GPU (the critic's endpoints loaded together,
# megatron's fusions compiled on first call) and the GRPO step (FP8 rollouts). PyTriton from call 1.
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader; git log --oneline -1 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. python3 -c "import sys, aligner, megatron.core.models.gpt; from megatron.core import jit; print('jit_fuser', jit.jit_fuser.__name__, 'compile_fx imported', 'torch._inductor.compile_fx' in sys.modules)" 2>&1 | grep jit_fuser
A="--mode aligner --actor-gpus 0 --critic-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=64 ppo.forward_micro_batch_size=64 checkpoint.save_at_end=true --critic infer.micro_batch_size=64 train.micro_batch_size=64"
PYTHONPATH=. timeout 260 python3 scripts/bench_ppo_step.py --timeout 240 --exp-dir /tmp/ppo --out $OUT/r/ppo.json $A > $OUT/r/ppo.log 2>&1
echo "== ppo rc=$? t=$((SECONDS-S))"; grep -E "^aligner: step|^\| (generate|log-probs|critic wait|policy update|refit|step|peak)" $OUT/r/ppo.log; grep -E "check (kl_step0|logprob_mismatch_max)" $OUT/r/ppo.log; tail -2 $OUT/r/ppo.log | cut -c1-300
[ -f /tmp/ppo/critic.log ] && { grep -E "ready at" /tmp/ppo/critic.log | head -2 | cut -c1-200; grep -iE "error|Traceback|out of memory" /tmp/ppo/critic.log | head -3 | cut -c1-300; }
[ -f /tmp/ppo/critic/tritonserver.log ] && grep -E "loading:|successfully loaded" /tmp/ppo/critic/tritonserver.log | cut -c1-120 | head -8
cp /tmp/ppo/critic.log $OUT/r/ppo_critic.log 2>/dev/null; cp /tmp/ppo/critic/tritonserver.log $OUT/r/ppo_tritonserver.log 2>/dev/null
if [ $((SECONDS-S)) -lt 440 ]; then
  G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
  PYTHONPATH=. timeout 140 python3 scripts/bench_ppo_step.py $G --out $OUT/r/grpo.json > $OUT/r/grpo.log 2>&1
  echo "== grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo.log; tail -2 $OUT/r/grpo.log | cut -c1-300
fi
echo "done t=$((SECONDS-S))"
