#!/usr/bin/env bash
# The README's test command: install what is missing, then run the whole suite on CPU once per end
# of the supported megatron-core range (setup.py):
#   mcore016  megatron-core 0.16.1 in ./.venv (or the active environment, or $PYTHON), made with
#             python3;
#   mcore019  megatron-core $MCORE019_VERSION in ./.venv-mcore019, made with Python 3.12 (0.17 and
#             later need it; $PYTHON312, else python3.12, else pyenv's 3.12). PyPI's torch for
#             3.12 is the CUDA build: a 5.5 GB environment, unused CUDA libraries included.
# mcore019 runs only the tests marked mcore (those whose modules reach megatron-core through their
# imports: tests/mcore_marker.py); mcore016 runs them all. Each says how many it selected.
# Arguments go to pytest in each suite: paths among them replace the default (`tests`, pytest.ini's
# testpaths), options pass through (`bash tests/run.sh tests/kl -q`; a -m EXPR is joined with mcore
# in the mcore019 suite). SUITES="mcore016" (or "mcore019") runs one. Both run even when the first
# fails; the exit status is non-zero if either did.
set -euo pipefail
cd "$(dirname "$0")/.."
MCORE019_VERSION=${MCORE019_VERSION:-0.19.2}

say() { echo "tests/run.sh: $*" >&2; }

python312() {
  local candidate
  for candidate in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"
      return
    fi
  done
  say "no Python 3.12 for the megatron-core $MCORE019_VERSION suite: set PYTHON312 to one"
  return 1
}

suite() {  # NAME [env settings of the install scripts ...] -- pytest arguments
  local name=$1 settings=() py started=$SECONDS
  shift
  while [[ "$1" != -- ]]; do settings+=("$1"); shift; done
  shift
  env "${settings[@]}" bash tools/install_cpu.sh  # the settings stay out of the tests' environment
  py=$(env "${settings[@]}" bash tools/python.sh)
  say "$name: megatron-core $("$py" -c 'from importlib.metadata import version; print(version("megatron-core"))'), Python $("$py" -c 'import platform; print(platform.python_version())')"
  PATH="$(dirname "$(command -v "$py")"):$PATH"  # scripts the tests run find the same python3
  export PATH OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=1
  local status=0
  "$py" -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 "$@" || status=$?
  say "$name: pytest exited $status after $((SECONDS - started)) s (installs included)"
  return "$status"
}

only_mcore() {  # pytest arguments -> the same with -m "mcore" (joined with a -m EXPR given)
  local args=() expr=""
  while (($#)); do
    case "$1" in
      -m) expr=${2:-}; shift; (($#)) && shift ;;
      -m*) expr=${1#-m}; shift ;;
      *) args+=("$1"); shift ;;
    esac
  done
  printf '%s\0' ${args[@]+"${args[@]}"} -m "mcore${expr:+ and ($expr)}"
}

status=0
for name in ${SUITES:-mcore016 mcore019}; do
  case "$name" in
    mcore016) (suite "$name" -- "$@") || status=1 ;;
    mcore019) (py312=$(python312)
               mapfile -d '' args < <(only_mcore "$@")
               suite "$name" -u PYTHON -u VIRTUAL_ENV VENV=.venv-mcore019 BASE_PYTHON="$py312" \
                     MCORE_VERSION="$MCORE019_VERSION" -- "${args[@]}") || status=1 ;;
    *) say "unknown suite '$name' in SUITES (mcore016, mcore019)"; exit 2 ;;
  esac
done
exit "$status"
