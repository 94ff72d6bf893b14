#!/usr/bin/env bash
# Evaluate a math checkpoint the way the reference did: 32 samples per problem at temperature
# 0.8, top-p 0.9, up to 28000 new tokens, seed 429; Pass@1 (mean over samples) and Pass@k per
# benchmark (MATH500, Minerva, AIME 2024, AIME 2025, OlympiadBench). Grading reads only the
# text after the model's </think>.
#
#   CKPT=/ckpt/math-1.5b-topk-24k MODEL_DIR=/models/DeepSeek-R1-Distill-Qwen-1.5B \
#   DATA_DIR=/data/math-eval bash examples/eval_math.sh
#
# Environment:
#   CKPT        a trainer checkpoint: its --save directory (the latest step) or one iter_N
#               directory; exported to HF first, into HF_DIR (default CKPT-hf), or
#   HF_MODEL    an HF model directory to evaluate directly (e.g. the base model)
#   MODEL_DIR   the base model's HF directory (tokenizer and config template for the export)
#   DATA_DIR    EVAL_FILES inside it (jsonl/parquet with `problem`, `answer`, `data_source`)
#   OUT_DIR     results (default: <model>-eval-math)
#   N_SAMPLES   samples per problem (default 32)
#   MAX_NEW_TOKENS  response budget (default 28000)
#   DRY_RUN=1   check the commands and the data files without generating
# shellcheck source=examples/lib/launch.sh
source "$(dirname "$0")/lib/launch.sh"
require_env DATA_DIR
EVAL_FILES=${EVAL_FILES:-math500.jsonl minerva.jsonl aime24.jsonl aime25.jsonl olympiadbench.jsonl}
N_SAMPLES=${N_SAMPLES:-32}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-28000}

resolve_eval_hf_dir
OUT_DIR=${OUT_DIR:-$HF_DIR-eval-math}

eval_data_files

emapg_evaluate \
    --task math \
    --data-path "${DATA[@]}" \
    --load "$HF_DIR" \
    --num-samples-per-prompt "$N_SAMPLES" \
    --temperature 0.8 \
    --top-p 0.9 \
    --max-new-tokens "$MAX_NEW_TOKENS" \
    --seed 429 \
    --think-end-tag "</think>" \
    --out "$OUT_DIR"
