#!/bin/bash
# fifty-fourth session, call 1 (s53d.sh as prepared, run now): megatron's fusions compiled on first call (aligner/lazy_fusions.py) in each
# training forward and backward on a GPU (train_families.py), and the engine on each family (engine_families.py), at HEAD.
S=$SECONDS; git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile .whl-min/*.whl 2>&1 | tail -1
mkdir -p $OUT/r
PYTHONPATH=. timeout 280 python3 tests/gpu/train_families.py --out $OUT/r/train_families.json > $OUT/r/train_families.log 2>&1
echo "== train_families rc=$? t=$((SECONDS-S))"; grep -vi "warn" $OUT/r/train_families.log | tail -12 | cut -c1-200
PYTHONPATH=. timeout 250 python3 tests/gpu/engine_families.py --out $OUT/r/engine_families.json > $OUT/r/engine_families.log 2>&1
echo "== engine_families rc=$? t=$((SECONDS-S))"; grep -vi "warn" $OUT/r/engine_families.log | tail -8 | cut -c1-200
