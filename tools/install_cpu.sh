#!/usr/bin/env bash
# Install emapg-megatron for CPU use, idempotently: a second run installs nothing.
# CPU torch goes first: an unpinned torch would pull several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${EXTRAS:-test,math,search}
stamp=".install-stamp"
want="$(sha256sum setup.py | cut -c1-16) $EXTRAS torch==$TORCH_VERSION"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import emapg_megatron, megatron.core, torch" 2>/dev/null; then
  exit 0
fi
if ! "$PY" -c "import torch, sys; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null; then
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PY" -m pip install -q -e ".[$EXTRAS]"
echo "$want" > "$stamp"
