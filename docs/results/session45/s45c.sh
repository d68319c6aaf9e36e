#!/bin/bash
# an H200: the goals first (s37h200.sh), else the GRPO step on real models' shapes (s45b.sh)
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
case "$name" in *H200*) bash gpu_scratch/s37h200.sh;; *) bash gpu_scratch/s45b.sh;; esac
