#!/usr/bin/env bash
# On-policy distillation on 2 CPU cores (about 6 minutes, plus the first install): a teacher is trained with EMA-PG on the
# built-in copy task (or reused from OUT/teacher-ckpt), then a smaller student (1 layer instead of
# 2) is trained three ways from the same initial weights:
#   opd         distillation alone (--no-task-reward), Top-k forward KL to the teacher, unbiased tail
#   opd-renorm  the same with the tail NeMo-RL computes (the KL renormalised over the top-k)
#   rl          EMA-PG on the task's reward alone
# It writes OUT/opd_curves.png and prints, as its last line, one JSON object: teacher_reward and
# each run's first step whose 10-step mean reward reaches 90% of the teacher's.
# OUT (default runs/opd-tiny), TEACHER_STEPS (300) and STEPS (200) can be set.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install_cpu.sh >&2
PY=$(bash tools/python.sh)
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
OUT=${OUT:-runs/opd-tiny}
TEACHER_STEPS=${TEACHER_STEPS:-300}
STEPS=${STEPS:-200}

train() { "$PY" -m emapg_megatron.launch --standalone --nproc-per-node 2 --preset tiny-cpu "$@" >&2; }

if [ ! -f "$OUT/teacher-ckpt/latest_checkpointed_iteration.txt" ]; then
  train --train-iters "$TEACHER_STEPS" --save "$OUT/teacher-ckpt" --save-interval "$TEACHER_STEPS" \
        --log-dir "$OUT/teacher" --overwrite
fi
STUDENT=(--num-layers 1 --train-iters "$STEPS" --overwrite)
OPD=(--teacher-checkpoint "$OUT/teacher-ckpt" --no-task-reward --kl-coef 1 --kl-loss-type topk-forward)
train "${STUDENT[@]}" "${OPD[@]}" --kl-tail unbiased --log-dir "$OUT/opd"
train "${STUDENT[@]}" "${OPD[@]}" --kl-tail renorm --log-dir "$OUT/opd-renorm"
train "${STUDENT[@]}" --log-dir "$OUT/rl"
"$PY" tools/opd_report.py "$OUT"
