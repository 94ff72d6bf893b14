# shellcheck shell=bash
# Sourced by the example scripts. Launches the trainer with torchrun on NNODES x NPROC GPUs, or,
# with DRY_RUN=1, validates the whole configuration in one CPU process (reads only config.json:
# no weights, no tokenizer, no GPU) for the same world size and prints a summary
# (DRY_RUN_OUTPUT=json: every resolved setting). The scripts run the project's interpreter, as
# tools/python.sh finds it ($PYTHON, the active virtual environment, ./.venv), like every tool.
#
# Multi-node: run the same script on every node with NNODES, NODE_RANK (0..NNODES-1),
# MASTER_ADDR (node 0's address) and MASTER_PORT set; see docker/README.md.
set -euo pipefail

: "${NNODES:=1}" "${NPROC:=8}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${DRY_RUN:=0}"
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=$(bash "$REPO_ROOT/tools/python.sh")

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
        exec "$PYTHON" -m emapg_megatron.train --dry-run="${DRY_RUN_OUTPUT:-summary}" \
            --world-size "$((NNODES * NPROC))" "$@"
    fi
    # Megatron orders TP communication after compute only with one CUDA connection.
    export CUDA_DEVICE_MAX_CONNECTIONS=1
    # vLLM's sleep mode allocates through its own CUDA memory pool, which does not support
    # expandable segments: never set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True here.
    # emapg-train: every flag checked in one process, then torchrun starts the ranks.
    exec "$PYTHON" -m emapg_megatron.launch --nnodes "$NNODES" --nproc-per-node "$NPROC" \
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" "$@"
}

checkpoint_step_dir() {  # checkpoint_step_dir CKPT: the step a checkpoint names (a --save root: its latest)
    local tracker="$1/latest_checkpointed_iteration.txt"
    if [[ -f "$tracker" ]]; then
        printf '%s/iter_%07d\n' "$(cd "$1" && pwd)" "$(tr -dc 0-9 < "$tracker")"
    else
        (cd "$1" 2>/dev/null && pwd) || echo "$1"
    fi
}

# emapg_convert_to_hf CKPT OUT [TEMPLATE]: trainer checkpoint -> HF dir. An export of the same
# step is reused; after the checkpoint moved on (a later step saved) it is exported again.
emapg_convert_to_hf() {
    local step cmd=("$PYTHON" -m emapg_megatron.checkpoint.cli mcore-to-hf --load "$1" --out "$2")
    step=$(checkpoint_step_dir "$1")
    [[ -n "${3:-}" ]] && cmd+=(--hf-template "$3")
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "dry run: ${cmd[*]}" >&2
        return 0
    fi
    if [[ -f "$2/config.json" && "$(cat "$2/.emapg-export-of" 2>/dev/null)" == "$step" ]]; then
        echo "using the existing HF export $2 (of $step)" >&2
        return 0
    fi
    [[ -e "$2" ]] && cmd+=(--overwrite)
    "${cmd[@]}"
    echo "$step" > "$2/.emapg-export-of"
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

# The HF directory an evaluation reads: $HF_MODEL, or $CKPT converted to HF format (the tokenizer
# from the --load-hf folder the run recorded, or from MODEL_DIR when set). Sets HF_DIR.
resolve_eval_hf_dir() {
    if [[ -n "${HF_MODEL:-}" ]]; then
        HF_DIR=$HF_MODEL
    else
        require_env CKPT
        HF_DIR=${HF_DIR:-${CKPT%/}-hf}
        emapg_convert_to_hf "$CKPT" "$HF_DIR" "${MODEL_DIR:-}"
    fi
}

# DATA=( $DATA_DIR/<each file in $EVAL_FILES> )
eval_data_files() {
    DATA=()
    for f in $EVAL_FILES; do DATA+=("$DATA_DIR/$f"); done
}
