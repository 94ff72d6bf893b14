#!/usr/bin/env bash
# The main job: a tiny EMA-PG run (Top-k reverse KL, unbiased tail, fp32 EMA anchor) of a
# Megatron GPT at TP=2 on 2 CPU processes (gloo), on the built-in copy task.
# Installs what is missing first (into ./.venv unless a virtual environment is active).
# Extra flags are passed to the trainer; run it again with --overwrite to replace runs/tiny-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh
PY=$(bash tools/python.sh)
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
# emapg-train checks every flag in one process first, then starts the 2 ranks with torchrun.
exec "$PY" -m emapg_megatron.launch --standalone --nproc-per-node 2 --preset tiny-cpu "$@"
