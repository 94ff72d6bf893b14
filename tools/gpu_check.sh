#!/usr/bin/env bash
# The GPU check in one command: the GPU test set (pytest -m gpu tests/gpu) and the GPU benchmarks
# (fused Top-k KL vs Megatron CE; a bf16 trainer run of a Qwen2.5-0.5B-shaped model), each writing
# JSON into OUT_DIR (default runs/gpu_check), then a summary. About 10 minutes at most on one H100.
#
#   bash tools/gpu_check.sh [OUT_DIR] [--dry-run] [--only STAGE ...] [--budget SECONDS]
#
# See docs/gpu.md; the stages are in tools/run_gpu_checks.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "$(bash tools/python.sh)" tools/run_gpu_checks.py "$@"
