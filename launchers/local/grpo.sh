#!/usr/bin/env bash
# GRPO on one machine: the actor job alone, its reward a function it runs itself (no critic job). No arguments: the
# CPU demo (conf/grpo_demo.yaml: a tiny model learns single-digit sums). Options: launchers/local/ppo.py --help
# (e.g. --actor-config grpo_math --actor KEY=VALUE ...). Prints `metrics: <path of metrics.jsonl>` last.
# On first use it sets up the CPU environment (.venv, scripts/setup_cpu.sh) unless PYTHON names another interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -z "${PYTHON:-}" ] && [ ! -x "$here/.venv/bin/python" ]; then
  echo "[grpo] no .venv yet: setting it up (scripts/setup_cpu.sh)"
  bash "$here/scripts/setup_cpu.sh"
fi
py="${PYTHON:-$here/.venv/bin/python}"
exec "$py" "$here/launchers/local/ppo.py" --actor-only --actor-config grpo_demo --exp-dir results/grpo_demo "$@"
