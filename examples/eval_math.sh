#!/usr/bin/env bash
# Evaluate a math checkpoint the way the reference did: 32 samples per problem at temperature
# 0.8, top-p 0.9, up to 28000 new tokens, seed 429; Pass@1 (mean over samples) and Pass@k per
# benchmark (MATH500, Minerva, AIME 2024, AIME 2025, OlympiadBench). Grading reads only the
# text after the model's </think>.
#
#   CKPT=/ckpt/math-1.5b-topk-24k DATA_DIR=/data/math-eval bash examples/eval_math.sh
#   CKPT=SAVE_DIR bash examples/eval_math.sh    # a quick check on the shipped data/samples/math.jsonl
#
# Environment:
#   CKPT        a trainer checkpoint: its --save directory (the latest step) or one iter_N
#               directory; exported to HF first, into HF_DIR (default CKPT-hf; exported again
#               when the checkpoint has a later step than the export), or
#   HF_MODEL    an HF model directory to evaluate directly (e.g. the base model)
#   MODEL_DIR   optional: an HF directory whose tokenizer and config the export takes (default:
#               the --load-hf folder the run recorded)
#   DATA_DIR    EVAL_FILES inside it (jsonl/parquet with `problem`, `answer`, `data_source`);
#               default: the shipped sample (data/samples/math.jsonl, 4 samples, 64 new tokens)
#   OUT_DIR     results (default: <model>-eval-math)
#   N_SAMPLES   samples per problem (default 32)
#   MAX_NEW_TOKENS  response budget (default 28000)
#   DRY_RUN=1   check the commands and the data files without generating
# shellcheck source=examples/lib/launch.sh
source "$(dirname "$0")/lib/launch.sh"
if [[ -z "${DATA_DIR:-}" ]]; then
    DATA_DIR=$REPO_ROOT/data/samples EVAL_FILES=${EVAL_FILES:-math.jsonl}
    N_SAMPLES=${N_SAMPLES:-4} MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-64}
    echo "no DATA_DIR: evaluating on the shipped sample $DATA_DIR/$EVAL_FILES ($N_SAMPLES samples, $MAX_NEW_TOKENS new tokens); set DATA_DIR for the benchmarks" >&2
fi
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
