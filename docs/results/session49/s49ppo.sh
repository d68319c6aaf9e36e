#!/bin/bash
# forty-ninth session: the PPO step, both jobs on the one GPU, on real models' shapes (bench_ppo_step.py --mode
# aligner --hf-config, first run on a GPU), then the 1B benchmark shape as the same-machine baseline. PyTriton comes
# from the call before (carry .whl-triton); this call installs .whl (numpy 1.26, megatron-core, omegaconf 2.4.0).
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
python3 -c "import pytriton, numpy, megatron.core; print('pytriton ok, numpy', numpy.__version__)" 2>&1 | tail -1
mkdir -p $OUT/r
A="--mode aligner --actor-gpus 0 --critic-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=16 --critic train.micro_batch_size=16 infer.micro_batch_size=32"
for c in qwen3_0.6b llama3.2_1b base; do
  [ $((SECONDS-S)) -lt 370 ] || { echo "$c skipped"; continue; }
  H="--hf-config gpu_scratch/cfg/$c.json"; [ $c = base ] && H=""
  PYTHONPATH=. timeout 200 python3 scripts/bench_ppo_step.py $H --timeout 180 --exp-dir /tmp/ppo_$c --out $OUT/r/ppo_$c.json $A > $OUT/r/ppo_$c.log 2>&1
  echo "== $c rc=$? t=$((SECONDS-S))"; grep -E "^aligner: step|^\| (generate|log-probs|critic wait|policy update|refit|step|peak)" $OUT/r/ppo_$c.log; grep -E "check (kl_step0|logprob_mismatch_max)" $OUT/r/ppo_$c.log
  tail -3 $OUT/r/ppo_$c.log | cut -c1-300
  [ -f /tmp/ppo_$c/critic.log ] && grep -iE "error|Traceback|out of memory" /tmp/ppo_$c/critic.log | head -3 | cut -c1-300
done
echo "done t=$((SECONDS-S))"
