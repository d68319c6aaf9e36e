#!/bin/bash
# fifty-second session: issue 17's goals at HEAD on one H200 (the last whole sweep of them was before many later
# changes): bench_generation (FP8 weights and cache, B=64/256), the PPO step with both jobs on the one GPU, the GRPO
# step (FP8 rollouts), bench_model --preset 1b. PyTriton from call 1 (carry .whl-triton); this call installs .whl.
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
python3 -c "import pytriton, numpy, megatron.core; print('pytriton ok, numpy', numpy.__version__)" 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 150 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/gen.json > $OUT/r/gen.log 2>&1
echo "== gen rc=$? t=$((SECONDS-S))"; tail -6 $OUT/r/gen.log | cut -c1-220
A="--mode aligner --actor-gpus 0 --critic-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=64 ppo.forward_micro_batch_size=64 checkpoint.save_at_end=true --critic infer.micro_batch_size=64 train.micro_batch_size=64"
PYTHONPATH=. timeout 240 python3 scripts/bench_ppo_step.py --timeout 220 --exp-dir /tmp/ppo --out $OUT/r/ppo.json $A > $OUT/r/ppo.log 2>&1
echo "== ppo rc=$? t=$((SECONDS-S))"; grep -E "^aligner: step|^\| (generate|log-probs|critic wait|policy update|refit|step|peak)" $OUT/r/ppo.log; grep -E "check (kl_step0|logprob_mismatch_max)" $OUT/r/ppo.log; tail -2 $OUT/r/ppo.log | cut -c1-300
[ -f /tmp/ppo/critic.log ] && grep -iE "error|Traceback|out of memory" /tmp/ppo/critic.log | head -3 | cut -c1-300
if [ $((SECONDS-S)) -lt 430 ]; then
  G="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=32 generation.decode_weights=fp8 generation.kv_dtype=fp8"
  PYTHONPATH=. timeout 130 python3 scripts/bench_ppo_step.py $G --out $OUT/r/grpo.json > $OUT/r/grpo.log 2>&1
  echo "== grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo.log; tail -2 $OUT/r/grpo.log | cut -c1-300
fi
if [ $((SECONDS-S)) -lt 510 ]; then
  PYTHONPATH=. timeout 80 python3 scripts/bench_model.py --preset 1b --attention sdpa --out $OUT/r/model.json > $OUT/r/model.log 2>&1
  echo "== model rc=$? t=$((SECONDS-S))"; tail -4 $OUT/r/model.log | cut -c1-220
fi
echo "done t=$((SECONDS-S))"
