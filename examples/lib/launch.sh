# shellcheck shell=bash
# Sourced by the example scripts. Launches the trainer with torchrun on NNODES x NPROC GPUs, or,
# with DRY_RUN=1, validates the whole configuration in one CPU process (reads only config.json:
# no weights, no tokenizer, no GPU) for the same world size.
#
# Multi-node: run the same script on every node with NNODES, NODE_RANK (0..NNODES-1),
# MASTER_ADDR (node 0's address) and MASTER_PORT set; see docker/README.md.
set -euo pipefail

: "${NNODES:=1}" "${NPROC:=8}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${DRY_RUN:=0}"
PYTHON=${PYTHON:-python3}

require_env() {  # require_env NAME...: fail with one line if a variable is unset or empty
    local name
    for name in "$@"; do
        if [[ -z "${!name:-}" ]]; then
            echo "error: set $name (see the comments at the top of $(basename "$0"))" >&2
            exit 2
        fi
    done
}

emapg_train() {  # emapg_train TRAINER_FLAGS...
    if [[ "$DRY_RUN" == 1 ]]; then
        exec "$PYTHON" -m emapg_megatron.train --dry-run --world-size "$((NNODES * NPROC))" "$@"
    fi
    # Megatron orders TP communication after compute only with one CUDA connection.
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    # vLLM's sleep mode allocates through its own CUDA memory pool, which does not support
    # expandable segments: never set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True here.
    # emapg-train: every flag checked in one process, then torchrun starts the ranks.
    exec "$PYTHON" -m emapg_megatron.launch --nnodes "$NNODES" --nproc-per-node "$NPROC" \
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"
}

emapg_convert_to_hf() {  # emapg_convert_to_hf CKPT OUT TEMPLATE: trainer checkpoint -> HF dir
    local cmd=("$PYTHON" -m emapg_megatron.checkpoint.cli mcore-to-hf --load "$1" --out "$2"
               --hf-template "$3")
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "dry run: ${cmd[*]}" >&2
        return 0
    fi
    [[ -f "$2/config.json" ]] && { echo "using the existing HF export $2" >&2; return 0; }
    "${cmd[@]}"
}

emapg_evaluate() {  # emapg_evaluate EVALUATE_FLAGS...
    if [[ "$DRY_RUN" == 1 ]]; then
        # Parse the flags with evaluate's own parser and check the data files; generate nothing.
        "$PYTHON" - "$@" <<'PY'
import os
import sys

from emapg_megatron.errors import ConfigError
from emapg_megatron.evaluate import parse_args

try:
    cfg = parse_args(sys.argv[1:])
except ConfigError as e:
    sys.exit(f"error: {e}")
missing = [d for d in cfg.task.data_path if not os.path.exists(d)]
if missing:
    sys.exit(f"error: --data-path file(s) not found: {' '.join(missing)}")
print("dry run: python -m emapg_megatron.evaluate " + " ".join(sys.argv[1:]))
PY
        return
    fi
    "$PYTHON" -m emapg_megatron.evaluate "$@"
}

# The HF directory an evaluation reads: $HF_MODEL, or $CKPT converted to HF format (MODEL_DIR
# supplies config.json and the tokenizer). Sets HF_DIR.
resolve_eval_hf_dir() {
    if [[ -n "${HF_MODEL:-}" ]]; then
        HF_DIR=$HF_MODEL
    else
        require_env CKPT MODEL_DIR
        HF_DIR=${HF_DIR:-$CKPT-hf}
        emapg_convert_to_hf "$CKPT" "$HF_DIR" "$MODEL_DIR"
    fi
}

# DATA=( $DATA_DIR/<each file in $EVAL_FILES> )
eval_data_files() {
    DATA=()
    for f in $EVAL_FILES; do DATA+=("$DATA_DIR/$f"); done
}
