#!/usr/bin/env bash
# The MoE demo: EMA-PG (Top-k reverse KL, unbiased tail, fp32 EMA anchor over every expert) on a
# tiny Qwen3-MoE-shaped policy (4 experts, top-2) at expert parallelism 2 on 2 CPU processes
# (gloo), with routing replay R2 and a small load-balancing loss, on the built-in copy task
# (--preset moe-tiny-cpu), once per seed (SEEDS, default "1 2 3 4 5"; 150 steps each).
# Installs what is missing first (into ./.venv unless a virtual environment is active).
# Each seed logs into OUT/seed-<S> (OUT: runs/moe-tiny-cpu). The last line is one JSON object
# (tools/moe_report.py): reward over the first and last 10 steps, expert load, load-balancing
# loss and the sampler/trainer log-prob difference per seed with their median, min and max, and
# the machine; OUT/moe_seeds.png has the reward and each layer's expert-load curves.
# Extra flags go to every seed's run; add --overwrite to replace an earlier run's seeds.
set -euo pipefail
source "$(dirname "$0")/lib/cpu_demo.sh"
OUT=${OUT:-runs/moe-tiny-cpu}
per_seed "$OUT" --preset moe-tiny-cpu "$@"
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/moe_report.py "$OUT" --seeds $SEEDS
