#!/bin/bash
# forty-sixth session: an H200: the goals first (s37h200.sh), then the GRPO step on real models' shapes (s46b.sh)
# while the call has time; another card: s46b.sh alone
export T0=$(date +%s)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$name" in *H200*) bash gpu_scratch/s46h200.sh; bash gpu_scratch/s46b.sh;; *) bash gpu_scratch/s46b.sh;; esac
