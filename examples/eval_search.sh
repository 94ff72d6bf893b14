#!/usr/bin/env bash
# Evaluate a search-agent checkpoint (paper Table 2): exact match of the final <answer>, one
# greedy sample per question, at most 4 turns, on the General QA (NQ, TriviaQA, PopQA) and
# Multi-Hop QA (HotpotQA, 2Wiki, Musique, Bamboogle) test sets; results per data source.
#
#   CKPT=/ckpt/search-3b-topk MODEL_DIR=/models/Qwen2.5-3B DATA_DIR=/data/nq_hotpotqa \
#   RETRIEVER=http://127.0.0.1:8000/retrieve bash examples/eval_search.sh
#
# Environment:
#   CKPT or HF_MODEL, MODEL_DIR, OUT_DIR, DRY_RUN   as in eval_math.sh
#   DATA_DIR    EVAL_FILES inside it (default test.parquet: the seven test sets, Search-R1's
#               format, one `data_source` per set)
#   RETRIEVER   the retriever service URL or a corpus jsonl (as for training)
# shellcheck source=examples/lib/launch.sh
source "$(dirname "$0")/lib/launch.sh"
require_env DATA_DIR RETRIEVER
EVAL_FILES=${EVAL_FILES:-test.parquet}

resolve_eval_hf_dir
OUT_DIR=${OUT_DIR:-$HF_DIR-eval-search}

eval_data_files

emapg_evaluate \
    --task search \
    --data-path "${DATA[@]}" \
    --load "$HF_DIR" \
    --retriever "$RETRIEVER" \
    --max-turns 4 \
    --num-samples-per-prompt 1 \
    --temperature 0.0 \
    --top-p 1.0 \
    --max-new-tokens 500 \
    --seed 0 \
    --out "$OUT_DIR"
