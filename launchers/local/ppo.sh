#!/usr/bin/env bash
# PPO on one machine (critic job + actor job). No arguments: the CPU demo. See launchers/local/ppo.py --help.
# On first use it sets up the CPU environment (.venv, scripts/setup_cpu.sh) unless PYTHON names another interpreter.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -z "${PYTHON:-}" ] && [ ! -x "$here/.venv/bin/python" ]; then
  echo "[ppo] no .venv yet: setting it up (scripts/setup_cpu.sh)"
  bash "$here/scripts/setup_cpu.sh"
fi
py="${PYTHON:-$here/.venv/bin/python}"
exec "$py" "$here/launchers/local/ppo.py" "$@"
