#!/bin/bash
# fifty-first session: SmolLM3 (layers without RoPE) on a GPU: hf_families (the image's numpy 2: only megatron-core
# and omegaconf from .whl), engine_families and train_families with the SmolLM3 kinds; then (every wheel)
# bench_generation on SmolLM3-3B's shape in bf16 and with FP8 weights and cache, and the GRPO step on it.
S=$SECONDS
name=$(nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader); echo "$name"; git log --oneline -1 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile .whl/megatron_core*.whl .whl/omegaconf*.whl .whl/antlr4*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 120 python3 tests/gpu/hf_families.py --kinds smollm3 llama --out $OUT/r/hf_families.json > $OUT/r/hf_families.log 2>&1
rc=$?; echo "hf_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/hf_families.log | cut -c1-170; [ $rc -eq 0 ] || tail -5 $OUT/r/hf_families.log | cut -c1-300
PYTHONPATH=. timeout 150 python3 tests/gpu/engine_families.py --families smollm3-style --out $OUT/r/engine_families.json > $OUT/r/engine_families.log 2>&1
rc=$?; echo "engine_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/engine_families.log | cut -c1-220; [ $rc -eq 0 ] || tail -5 $OUT/r/engine_families.log | cut -c1-300
PYTHONPATH=. timeout 100 python3 tests/gpu/train_families.py --families smollm3-style llama3.2-style --out $OUT/r/train_families.json > $OUT/r/train_families.log 2>&1
rc=$?; echo "train_families rc=$rc t=$((SECONDS-S))"; grep -E "^\|" $OUT/r/train_families.log | cut -c1-220; [ $rc -eq 0 ] || tail -5 $OUT/r/train_families.log | cut -c1-300
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
for w in bf16 fp8; do
  W=""; [ $w = fp8 ] && W="--decode-weights fp8 --kv-dtype fp8"
  PYTHONPATH=. timeout 120 python3 scripts/bench_generation.py --skip-hf --hf-config gpu_scratch/cfg/smollm3_3b.json $W --batch-sizes 64 256 --out $OUT/r/gen_smollm3_$w.json > $OUT/r/gen_smollm3_$w.log 2>&1
  echo "== gen $w rc=$? t=$((SECONDS-S))"; tail -7 $OUT/r/gen_smollm3_$w.log | cut -c1-220
done
if [ $((SECONDS-S)) -lt 420 ]; then
  A="--mode grpo --actor-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=16 generation.decode_weights=fp8 generation.kv_dtype=fp8"
  PYTHONPATH=. timeout 150 python3 scripts/bench_ppo_step.py --hf-config gpu_scratch/cfg/smollm3_3b.json $A --out $OUT/r/grpo_smollm3.json > $OUT/r/grpo_smollm3.log 2>&1
  echo "== grpo rc=$? t=$((SECONDS-S))"; grep -E "^\| (generate|log-probs|policy update|step|generated|peak)" $OUT/r/grpo_smollm3.log; grep -E "check (kl_step0|logprob_mismatch)" $OUT/r/grpo_smollm3.log; tail -2 $OUT/r/grpo_smollm3.log | cut -c1-300
fi
echo "done t=$((SECONDS-S))"
