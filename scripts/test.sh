#!/usr/bin/env bash
# The test command (README, .ci/run): sets up the CPU environment on first use (scripts/setup_cpu.sh), then lint,
# format check and the test suite. Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/unit -x`).
# Two pytest workers (ALIGNER_TEST_WORKERS; 0 runs in one process), each taking whole test files: most of the
# functional tests' time is processes starting and stopping, which two files overlap well on two cores. The
# longest files go first (tests/conftest.py: FILE_SECONDS), so the run does not end with one worker alone.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import aligner, megatron.core, pytriton, ruff, triton, xdist" 2>/dev/null; then
  echo "[test] setting up .venv first (scripts/setup_cpu.sh)"
  bash scripts/setup_cpu.sh
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -n "${ALIGNER_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
