#!/usr/bin/env bash
# PPO on one machine (critic job + actor job). No arguments: the CPU demo. See launchers/local/ppo.py --help.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
py="${PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py=python3
exec "$py" "$here/launchers/local/ppo.py" "$@"
