#!/usr/bin/env bash
# Install emapg-megatron for CPU use, idempotently: a second run installs nothing.
#
# Where: into the active virtual environment ($VIRTUAL_ENV), or the interpreter $PYTHON names;
# else into ./.venv (or the folder $VENV names), made here with $BASE_PYTHON (python3 unless
# set); the scripts that call this then run its python (tools/python.sh). What: torch first, its
# CPU build from PyTorch's CPU wheel index when that is reachable, else from the plain index (an
# unpinned torch would pull several GB of CUDA wheels; for Python 3.12 the plain index has only
# the CUDA build), then the package with the test, math and search extras and megatron-core at
# $MCORE_VERSION when set (else the newest that setup.py's range and the Python allow).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-test,math,search,wandb}
CPU_INDEX=${CPU_INDEX:-https://download.pytorch.org/whl/cpu}
MCORE_VERSION=${MCORE_VERSION:-}

step() { echo "install_cpu: $*" >&2; }

PY=$(bash tools/python.sh --for-install)
venv=$(dirname "$(dirname "$PY")")
if [[ -z "${PYTHON:-}${VIRTUAL_ENV:-}" && ! -x "$PY" ]]; then
  step "making a virtual environment in $venv with ${BASE_PYTHON:-python3} (activate one, or set PYTHON, to install elsewhere)"
  if ! "${BASE_PYTHON:-python3}" -m venv "$venv"; then
    rm -rf "$venv"
    echo "error: could not make a virtual environment in $venv with ${BASE_PYTHON:-python3} (install its venv module, e.g. python3-venv, or set PYTHON to an interpreter to install into)" >&2
    exit 1
  fi
fi
mcore_pin=()
[[ -z "$MCORE_VERSION" ]] || mcore_pin=("megatron-core==$MCORE_VERSION")
stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.emapg-install-stamp"
want="$(sha256sum setup.py | cut -c1-16) $EXTRAS torch==$TORCH_VERSION${mcore_pin:+ $mcore_pin}"
# Installed already: the stamp matches and the packages are there (found, not imported: a check in
# well under a second instead of the ~20 s importing torch and Megatron takes).
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "
import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ('emapg_megatron', 'megatron.core', 'torch')))" 2>/dev/null; then
  exit 0
fi
started=$SECONDS
if ! "$PY" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null; then
  if "$PY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
    step "torch $TORCH_VERSION, CPU build, from $CPU_INDEX (about 200 MB) ..."
    "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
  else
    step "torch $TORCH_VERSION from the package index ($CPU_INDEX is not reachable; where no CPU wheel is at hand, e.g. Python 3.12, that is the CUDA build with its CUDA libraries, about 4.5 GB, unused on the CPU) ..."
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi
step "emapg-megatron[$EXTRAS] and its dependencies (megatron-core${MCORE_VERSION:+ $MCORE_VERSION}, transformers, datasets, ...) ..."
"$PY" -m pip install -q -e ".[$EXTRAS]" "${mcore_pin[@]}"
echo "$want" > "$stamp"
step "done in $((SECONDS - started)) s: $("$PY" -c 'import sys; print(sys.executable)')"
