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
source "$(dirname "$0")/lib/cpu_demo.sh"
OUT=${OUT:-runs/tiny-cpu}
per_seed "$OUT" --preset tiny-cpu "$@"
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/seed_report.py "$OUT" --seeds $SEEDS
