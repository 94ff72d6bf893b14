#!/usr/bin/env bash
# On-policy distillation on 2 CPU cores, over seeds. A teacher (the tiny-cpu preset, 2 layers) is
# trained once with EMA-PG on the built-in copy task (or reused from OUT/teacher-ckpt) and shared
# by every seed's students. For each seed (SEEDS, default "1 2 3 4 5") a smaller student (1 layer)
# is trained three ways from that seed's initial weights:
#   opd         distillation alone (--no-task-reward), Top-k forward KL to the teacher, unbiased tail
#   opd-renorm  the same with the tail NeMo-RL computes (the KL renormalised over the top-k)
#   rl          EMA-PG on the task's reward alone
# COPY_REWARD is the students' reward, the one rl learns from and every run is scored with: exact
# (the default: 1 when all three digits are copied, else 0; a sparse reward) or fraction (the share
# of the digits copied right, the main job's). opd and opd-renorm never see it (--no-task-reward). The teacher always learns from
# fraction; its reward is measured with COPY_REWARD over 20 steps of its frozen weights (exported to
# OUT/teacher-hf, run with --lr 0).
# Writes OUT/<COPY_REWARD>/seed-<S>/<run>/ and OUT/<COPY_REWARD>/opd_curves.png, and prints, as its
# last line, one JSON object (tools/opd_report.py): the seeds, the teacher's reward, and per run
# each seed's first step whose 10-step mean reward reaches 90% of the teacher's and its reward over
# the last 10 steps, with their median, min and max, and the machine.
# OUT (default runs/opd-tiny), SEEDS, COPY_REWARD, TEACHER_STEPS (300) and STEPS (200) can be set.
# Time on 2 cores: see BENCHMARKS.md ("Seeds").
set -euo pipefail
source "$(dirname "$0")/lib/cpu_demo.sh"
OUT=${OUT:-runs/opd-tiny}
COPY_REWARD=${COPY_REWARD:-exact}
TEACHER_STEPS=${TEACHER_STEPS:-300}
STEPS=${STEPS:-200}
RUNS=$OUT/$COPY_REWARD

train() { train_cpu --preset tiny-cpu "$@" >&2; }

if [ ! -f "$OUT/teacher-ckpt/latest_checkpointed_iteration.txt" ]; then
  echo "== the teacher: $TEACHER_STEPS steps" >&2
  train --train-iters "$TEACHER_STEPS" --save "$OUT/teacher-ckpt" --save-interval "$TEACHER_STEPS" \
        --log-dir "$OUT/teacher" --overwrite
fi
if [ ! -f "$OUT/teacher-hf/config.json" ]; then  # its weights alone, for a frozen run (--lr 0)
  "$PY" -m emapg_megatron.checkpoint.cli mcore-to-hf --load "$OUT/teacher-ckpt" --out "$OUT/teacher-hf" >&2
fi
echo "== the teacher's reward ($COPY_REWARD), frozen" >&2
train --load-hf "$OUT/teacher-hf" --lr 0 --train-iters 20 --copy-reward "$COPY_REWARD" \
      --log-dir "$RUNS/teacher" --overwrite
STUDENT=(--num-layers 1 --train-iters "$STEPS" --copy-reward "$COPY_REWARD" --overwrite)
OPD=(--teacher-checkpoint "$OUT/teacher-ckpt" --no-task-reward --kl-coef 1 --kl-loss-type topk-forward)
for seed in $SEEDS; do
  echo "== seed $seed of: $SEEDS" >&2
  train "${STUDENT[@]}" --seed "$seed" "${OPD[@]}" --kl-tail unbiased --log-dir "$RUNS/seed-$seed/opd"
  train "${STUDENT[@]}" --seed "$seed" "${OPD[@]}" --kl-tail renorm --log-dir "$RUNS/seed-$seed/opd-renorm"
  train "${STUDENT[@]}" --seed "$seed" --log-dir "$RUNS/seed-$seed/rl"
done
# shellcheck disable=SC2086  # one argument per seed
"$PY" tools/opd_report.py "$RUNS" --seeds $SEEDS
