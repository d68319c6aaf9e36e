#!/usr/bin/env bash
# GRPO on one machine: the actor job alone, its reward a function it runs itself (no critic job). No arguments: the
# CPU demo (conf/grpo_demo.yaml: a tiny model learns single-digit sums). Options: launchers/local/ppo.py --help
# (e.g. --actor-config grpo_math --actor KEY=VALUE ...). Prints `metrics: <path of metrics.jsonl>` last.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
exec "$py" "$here/launchers/local/ppo.py" --actor-only --actor-config grpo_demo --exp-dir results/grpo_demo "$@"
