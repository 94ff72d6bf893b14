#!/usr/bin/env bash
# The main job: a tiny EMA-PG run (Top-k reverse KL, unbiased tail, fp32 EMA anchor) of a
# Megatron GPT at TP=2 on 2 CPU processes (gloo), on the built-in copy task.
# Installs what is missing first. Extra flags are passed to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
exec torchrun --standalone --nproc_per_node 2 -m emapg_megatron.train --preset tiny-cpu "$@"
