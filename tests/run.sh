#!/usr/bin/env bash
# The README's test command: install what is missing, then run the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh
PY=$(bash tools/python.sh)
PATH="$(dirname "$(command -v "$PY")"):$PATH"  # scripts the tests run find the same python3
export PATH OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=1
exec "$PY" -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=15 "$@"
