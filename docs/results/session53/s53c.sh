#!/bin/bash
# fifty-third session, call 3 (the machine of calls 1-2, still warm, PyTriton and .whl installed): the PPO step with
# both jobs on one H100 at the recipe's micro-batches for that card (actor 16, critic train 16 / infer 32; s52b.sh's
# 64 / 64 were set for the H200 and ran out of memory here: ppo_mb64_oom.log).
S=$SECONDS; mkdir -p $OUT/r; python3 -c "import pytriton, numpy; print('numpy', numpy.__version__)"
A="--mode aligner --actor-gpus 0 --critic-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=16 checkpoint.save_at_end=true --critic train.micro_batch_size=16 infer.micro_batch_size=32"
PYTHONPATH=. timeout 300 python3 scripts/bench_ppo_step.py --timeout 280 --exp-dir /tmp/ppo2 --out $OUT/r/ppo.json $A > $OUT/r/ppo.log 2>&1
echo "== ppo rc=$? t=$((SECONDS-S))"; grep -E "^aligner: step" $OUT/r/ppo.log
grep -E "loading:|successfully loaded" /tmp/ppo2/critic/tritonserver.log | cut -c1-120 | head -8
