#!/bin/bash
# fifty-third session, call 1: PyTriton installed for call 2; generation B=64/256 FP8 and bench_model at HEAD.
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl-triton/*.whl .whl-min/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. python3 -c "import sys, aligner, megatron.core.models.gpt; from megatron.core import jit; print('jit_fuser', jit.jit_fuser.__name__, 'compile_fx imported', 'torch._inductor.compile_fx' in sys.modules)" 2>&1 | tail -2
PYTHONPATH=. timeout 200 python3 scripts/bench_generation.py --skip-hf --decode-weights fp8 --kv-dtype fp8 --batch-sizes 64 256 --out $OUT/r/gen.json > $OUT/r/gen.log 2>&1
echo "== gen rc=$? t=$((SECONDS-S))"; tail -8 $OUT/r/gen.log | cut -c1-220
PYTHONPATH=. timeout 150 python3 scripts/bench_model.py --preset 1b --attention sdpa --out $OUT/r/model.json > $OUT/r/model.log 2>&1
echo "== model rc=$? t=$((SECONDS-S))"; tail -5 $OUT/r/model.log | cut -c1-220
echo "done t=$((SECONDS-S))"
