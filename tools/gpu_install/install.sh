#!/usr/bin/env bash
# On the lent GPU machine, in the project root, once the .gpukit-*/ folders have arrived: check every
# part against its manifest and setup.py's pins, compile TE's torch extension for sm_90 (or reuse a
# built wheel), pip install into /tmp/site. Then: export PYTHONPATH=/tmp/site. docs/dev/gpu_kit.md.
# usage: bash tools/gpu_install/install.sh [--only mcore,te,vllm] [--dry-run]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 tools/gpu_install/kit.py install "$@"
