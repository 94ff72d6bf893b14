#!/usr/bin/env bash
# The LoRA demo: EMA-PG (Top-k reverse KL, unbiased tail) on tiny-cpu's Megatron GPT at TP=2 on 2
# CPU processes (gloo), its weights frozen and rank-8 adapters on every linear trained instead, the
# fp32 EMA anchor over the adapters only (--preset lora-tiny-cpu), on the built-in copy task, once
# per seed (SEEDS, default "1 2 3 4 5"; 150 steps each). Installs what is missing first (into
# ./.venv unless a virtual environment is active). Each seed logs into OUT/seed-<S> (OUT:
# runs/lora-tiny-cpu) and saves its adapters there (emapg-convert lora-to-peft exports them in
# peft's format). The last line is one JSON object (tools/seed_report.py): reward over the first
# and last 10 steps per seed with their median, min and max, and the machine.
# Extra flags go to every seed's run; add --overwrite to replace an earlier run's seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh
PY=$(bash tools/python.sh)
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
OUT=${OUT:-runs/lora-tiny-cpu}
SEEDS=${SEEDS:-1 2 3 4 5}
for seed in $SEEDS; do
  echo "== seed $seed of: $SEEDS" >&2
  "$PY" -m emapg_megatron.launch --standalone --nproc-per-node 2 --preset lora-tiny-cpu \
      --seed "$seed" --log-dir "$OUT/seed-$seed" --save "$OUT/seed-$seed/checkpoint" "$@"
done
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/seed_report.py "$OUT" --seeds $SEEDS
