#!/usr/bin/env bash
# Here (PyPI reachable): download what the lent GPU machine lacks and lay it out as the git-ignored
# folders .gpukit-*/ (<= 56 MiB each, one per transfer). Options: kit.py prepare --help; docs/dev/gpu_kit.md.
# usage: bash tools/gpu_install/prepare.sh [--only mcore,te,vllm]
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" tools/gpu_install/kit.py prepare "$@"
