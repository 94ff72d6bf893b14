# shellcheck shell=bash
# Sourced by the CPU demos (tiny_cpu.sh, moe_tiny_cpu.sh, lora_tiny_cpu.sh, opd_tiny_cpu.sh): moves
# to the repository root, installs what is missing (into ./.venv unless a virtual environment is
# active; its output goes to stderr, so a demo's stdout ends with its JSON line), sets PY (the
# project's interpreter, as tools/python.sh finds it), the CPU environment and SEEDS (default
# "1 2 3 4 5"), and defines train_cpu and per_seed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
bash tools/install_cpu.sh >&2
PY=$(bash tools/python.sh)
export OMP_NUM_THREADS=1 CUDA_DEVICE_MAX_CONNECTIONS=1
SEEDS=${SEEDS:-1 2 3 4 5}

# train_cpu FLAGS...: emapg-train on 2 gloo CPU processes (it checks every flag in one process
# first, then starts the ranks with torchrun).
train_cpu() {
    "$PY" -m emapg_megatron.launch --standalone --nproc-per-node 2 "$@"
}

# per_seed OUT FLAGS...: train_cpu once per seed of $SEEDS, one after the other, each logging into
# OUT/seed-<S>; "{seed}" in a flag becomes the seed (e.g. --save OUT/seed-{seed}/checkpoint).
per_seed() {
    local out=$1 seed
    shift
    for seed in $SEEDS; do
        echo "== seed $seed of: $SEEDS" >&2
        train_cpu --seed "$seed" --log-dir "$out/seed-$seed" "${@//\{seed\}/$seed}"
    done
}
