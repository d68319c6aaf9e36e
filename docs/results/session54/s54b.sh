#!/bin/bash
# fifty-fourth session, call 3 (the machine of call 1, s53d.sh, and call 2, PyTriton from .whl-triton: still warm):
# .whl, then the PPO step with both jobs on one H100 (s53c.sh's micro-batches) at this session's code: the job
# scripts' exit through exit_after_main and the critic's early close of PyTriton's request threads, first on a GPU.
S=$SECONDS; mkdir -p $OUT/r; git log --oneline -1 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
python3 -c "import pytriton, numpy; print('numpy', numpy.__version__)"
A="--mode aligner --actor-gpus 0 --critic-gpus 0 --steps 3 --warmup 1 --actor ppo.micro_batch_size=16 checkpoint.save_at_end=true --critic train.micro_batch_size=16 infer.micro_batch_size=32"
PYTHONPATH=. timeout 300 python3 scripts/bench_ppo_step.py --timeout 280 --exp-dir /tmp/ppo3 --out $OUT/r/ppo.json $A > $OUT/r/ppo.log 2>&1
echo "== ppo rc=$? t=$((SECONDS-S))"; grep -E "^aligner: step" $OUT/r/ppo.log
cp -r /tmp/ppo3/logs $OUT/r/critic_logs 2>/dev/null; grep -hE "stopping|could not|ended with|left after" /tmp/ppo3/logs/* | tail -5
ls /tmp | grep -c critic_ ; ps -eo args | grep -c "[t]riton_python_backend_stub"
