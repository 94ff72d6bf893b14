#!/usr/bin/env bash
# The LoRA demo, on 2 CPU processes (gloo), on the built-in copy task:
# 1. the base, once (reused from OUT/base when there): tiny-cpu's Megatron GPT at TP=2 trained with
#    every weight for BASE_STEPS (default 60) EMA-PG steps at seed 1 and saved to OUT/base/checkpoint,
#    a partly trained model standing in for a pretrained one;
# 2. for each seed (SEEDS, default "1 2 3 4 5"; 100 steps each): that base frozen
#    (--pretrained-checkpoint), rank-8 adapters on every linear trained with EMA-PG (Top-k reverse
#    KL, unbiased tail) and the fp32 EMA anchor over the adapters only (--preset lora-tiny-cpu);
#    each seed logs into OUT/seed-<S> and saves the adapters alone (their Adam state and EMA; the
#    base named by its sha256) into OUT/seed-<S>/checkpoint, which emapg-convert lora-to-peft
#    exports in peft's format.
# OUT defaults to runs/lora-tiny-cpu. Installs what is missing first (into ./.venv unless a
# virtual environment is active). The last line is one JSON object (tools/seed_report.py): each
# seed's reward over its first and last 10 steps, their median, min and max, and the machine; the
# base's own reward is in OUT/base/metrics.jsonl. Extra flags go to every seed's run; add
# --overwrite to replace an earlier run's seeds.
set -euo pipefail
source "$(dirname "$0")/lib/cpu_demo.sh"
OUT=${OUT:-runs/lora-tiny-cpu}
BASE_STEPS=${BASE_STEPS:-60}
BASE=$OUT/base/checkpoint
if [ ! -f "$BASE/latest_checkpointed_iteration.txt" ]; then
  echo "== the base: $BASE_STEPS full-weight steps" >&2
  train_cpu --preset tiny-cpu --seed 1 --train-iters "$BASE_STEPS" --save "$BASE" --log-dir "$OUT/base" \
      --overwrite >&2
fi
per_seed "$OUT" --preset lora-tiny-cpu --pretrained-checkpoint "$BASE/iter_$(printf %07d "$(cat "$BASE/latest_checkpointed_iteration.txt")")" \
    --save "$OUT/seed-{seed}/checkpoint" "$@"
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/seed_report.py "$OUT" --seeds $SEEDS
