#!/usr/bin/env bash
# The main job: a tiny EMA-PG run (Top-k reverse KL, unbiased tail, fp32 EMA anchor) of a
# Megatron GPT at TP=2 on 2 CPU processes (gloo), on the built-in copy task, once per seed
# (SEEDS, default "1 2 3 4 5"; 150 steps each), one after the other.
# Installs what is missing first (into ./.venv unless a virtual environment is active).
# Each seed logs into OUT/seed-<S> (OUT: runs/tiny-cpu). The last line is one JSON object
# (tools/seed_report.py): the seeds, each seed's mean reward over its first and last 10 steps,
# their median, min and max, and the machine; OUT/reward_seeds.png has every seed's curve.
# Extra flags go to every seed's run; add --overwrite to replace an earlier run's seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh
PY=$(bash tools/python.sh)
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
OUT=${OUT:-runs/tiny-cpu}
SEEDS=${SEEDS:-1 2 3 4 5}
for seed in $SEEDS; do
  echo "== seed $seed of: $SEEDS" >&2
  # emapg-train checks every flag in one process first, then starts the 2 ranks with torchrun.
  "$PY" -m emapg_megatron.launch --standalone --nproc-per-node 2 --preset tiny-cpu \
      --seed "$seed" --log-dir "$OUT/seed-$seed" "$@"
done
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/seed_report.py "$OUT" --seeds $SEEDS
