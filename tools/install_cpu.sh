#!/usr/bin/env bash
# Install emapg-megatron for CPU use, idempotently: a second run installs nothing.
#
# Where: into the active virtual environment ($VIRTUAL_ENV), or the interpreter $PYTHON names;
# else into ./.venv, made here (the scripts that call this then run ./.venv/bin/python; see
# tools/python.sh). What: CPU torch first, from PyTorch's CPU wheel index when it is reachable,
# else from the plain index (an unpinned torch would pull several GB of CUDA wheels), then the
# package with the test, math and search extras.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-test,math,search,wandb}
CPU_INDEX=${CPU_INDEX:-https://download.pytorch.org/whl/cpu}

step() { echo "install_cpu: $*" >&2; }

PY=$(bash tools/python.sh --for-install)
if [[ "$PY" == "$PWD/.venv/bin/python" && ! -x .venv/bin/python ]]; then
  step "making a virtual environment in .venv (activate it, or set PYTHON, to install elsewhere)"
  if ! "${BASE_PYTHON:-python3}" -m venv .venv; then
    step "could not make .venv (python3 -m venv failed): installing into $(command -v python3)"
    PY=python3
  fi
fi
stamp="$("$PY" -c 'import sys; print(sys.prefix)')/.emapg-install-stamp"
want="$(sha256sum setup.py | cut -c1-16) $EXTRAS torch==$TORCH_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import emapg_megatron, megatron.core, torch" 2>/dev/null; then
  exit 0
fi
started=$SECONDS
if ! "$PY" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null; then
  if "$PY" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=10)" 2>/dev/null; then
    step "torch $TORCH_VERSION, CPU build, from $CPU_INDEX (about 200 MB) ..."
    "$PY" -m pip install -q "torch==$TORCH_VERSION" --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
  else
    step "torch $TORCH_VERSION from the package index ($CPU_INDEX is not reachable) ..."
    "$PY" -m pip install -q "torch==$TORCH_VERSION"
  fi
fi
step "emapg-megatron[$EXTRAS] and its dependencies (megatron-core, transformers, datasets, ...) ..."
"$PY" -m pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
step "done in $((SECONDS - started)) s: $("$PY" -c 'import sys; print(sys.executable)')"
