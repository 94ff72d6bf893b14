#!/usr/bin/env bash
# The README's test command: install what is missing, then run the suite on CPU once per end of
# the supported megatron-core range (setup.py):
#   mcore016  megatron-core 0.16.1 in ./.venv (or the active environment, or $PYTHON), made with
#             python3: every test;
#   mcore019  megatron-core $MCORE019_VERSION in ./.venv-mcore019, made with Python 3.12 (0.17 and
#             later need it; $PYTHON312, else python3.12, else pyenv's 3.12): the tests marked
#             mcore (their modules reach megatron-core through their imports: tests/mcore_marker.py).
#             PyPI's torch for 3.12 is the CUDA build: a 5.5 GB environment, unused CUDA libraries
#             included.
# The installs are idempotent (a second run installs nothing). By default mcore019 goes first; the
# next suite's install runs in the background while a suite's tests run. The suites then run side by side on the CI machine's two
# cores (much of a suite is one busy process): the first suite's output as it runs, the other's
# when it ends; SUITES_PARALLEL=0 runs them one after the other. Each suite says how many tests
# it selected and how long it took.
# The real launches that test our own process handling (signals, the launcher, locks) and scripts
# (the examples' dry runs, the GPU rehearsal), marked one_suite(NAME), do not depend on
# megatron-core's version and are a third of a suite's time: each runs in the suite it names only
# (EMAPG_SUITE tells conftest.py which suite is running).
# Arguments go to pytest in each suite: paths among them replace the default (`tests`, pytest.ini's
# testpaths), options pass through (`bash tests/run.sh tests/kl -q`; a -m EXPR is joined with mcore
# in the mcore019 suite). SUITES="mcore016" (or "mcore019") runs one. Both run even when the first
# fails; the exit status is non-zero if either did. JUNIT_DIR=DIR writes each suite's junit XML to
# DIR/<suite>.xml (per-folder times: python tools/suite_durations.py DIR/*.xml).
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

settings() {  # NAME: the install scripts' settings of NAME's environment, one a line (kept out of
              # the tests' environment)
  case "$1" in
    mcore016) ;;
    mcore019) local py312
              py312=$(python312) || return 1
              printf '%s\n' -u PYTHON -u VIRTUAL_ENV VENV=.venv-mcore019 "BASE_PYTHON=$py312" \
                            "MCORE_VERSION=$MCORE019_VERSION" ;;
  esac
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

install() {  # NAME SETTINGS...: install NAME's environment
  local name=$1 started=$SECONDS
  shift
  env "$@" bash tools/install_cpu.sh || { say "$name: the install failed"; return 1; }
  say "$name: environment ready in $((SECONDS - started)) s"
}

suite() {  # NAME SETTINGS... -- pytest arguments: run NAME's tests in its installed environment
  local name=$1 settings=() py started=$SECONDS status=0
  shift
  while [[ "$1" != -- ]]; do settings+=("$1"); shift; done
  shift
  py=$(env ${settings[@]+"${settings[@]}"} bash tools/python.sh)
  say "$name: megatron-core $("$py" -c 'from importlib.metadata import version; print(version("megatron-core"))'), Python $("$py" -c 'import platform; print(platform.python_version())')"
  PATH="$(dirname "$(command -v "$py")"):$PATH"  # scripts the tests run find the same python3
  PYTHON=$py  # ... and tools/python.sh (every example script's interpreter) names it too
  export PATH PYTHON OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} CUDA_DEVICE_MAX_CONNECTIONS=1
  export EMAPG_SUITE=$name  # the launch tests marked one_suite(other) are left to the other suite
  if [[ "$name" == mcore019 ]]; then
    mapfile -d '' args < <(only_mcore "$@")
    set -- "${args[@]}"
  fi
  local junit=()  # JUNIT_DIR: each suite's junit XML there (tools/suite_durations.py reads it)
  [[ -z "${JUNIT_DIR:-}" ]] || { mkdir -p "$JUNIT_DIR"; junit=("--junitxml=$JUNIT_DIR/$name.xml"); }
  "$py" -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 ${junit[@]+"${junit[@]}"} "$@" || status=$?
  say "$name: pytest exited $status after $((SECONDS - started)) s"
  return "$status"
}

# The longer suite first (the mcore-marked tests' own suite takes longer side by side): the next
# suite's install then runs beside it and the shorter suite ends the run.
read -r -a suites <<< "${SUITES:-mcore019 mcore016}"
for name in "${suites[@]}"; do
  [[ "$name" == mcore016 || "$name" == mcore019 ]] || { say "unknown suite '$name' in SUITES (mcore016, mcore019)"; exit 2; }
done
parallel=${SUITES_PARALLEL:-1}
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT  # an install left running ends with us
declare -A background=()  # suite -> pid of its install, started while the suite before it ran
running=()  # suite:pid of the suites running in the background (SUITES_PARALLEL)
status=0
started=$SECONDS
for i in "${!suites[@]}"; do
  name=${suites[$i]}
  text=$(settings "$name") || { status=1; continue; }
  these=()
  [[ -z "$text" ]] || mapfile -t these <<< "$text"
  if [[ -n "${background[$name]:-}" ]]; then
    ok=0
    wait "${background[$name]}" || ok=$?
    cat "$logs/$name" >&2
    ((ok == 0)) || { status=1; continue; }
  else
    install "$name" ${these[@]+"${these[@]}"} || { status=1; continue; }
  fi
  next=${suites[$((i + 1))]:-}
  if [[ -n "$next" ]] && next_text=$(settings "$next" 2>/dev/null); then
    next_settings=()
    [[ -z "$next_text" ]] || mapfile -t next_settings <<< "$next_text"
    install "$next" ${next_settings[@]+"${next_settings[@]}"} > "$logs/$next" 2>&1 &
    background[$next]=$!
  fi
  if [[ "$parallel" != 1 || ${#suites[@]} == 1 ]]; then
    (suite "$name" ${these[@]+"${these[@]}"} -- "$@") || status=1
  elif ((${#running[@]} == 0)); then  # the first suite's output is shown as it runs
    (suite "$name" ${these[@]+"${these[@]}"} -- "$@") &
    running+=("$name:$!")
  else  # the others' when they end
    say "$name: running beside ${running[0]%%:*}; its output follows when it ends"
    (suite "$name" ${these[@]+"${these[@]}"} -- "$@") > "$logs/$name.out" 2>&1 &
    running+=("$name:$!")
  fi
done
for entry in ${running[@]+"${running[@]}"}; do
  name=${entry%%:*}
  wait "${entry#*:}" || status=1
  if [[ -f "$logs/$name.out" ]]; then
    say "---- $name (ran beside the suite above) ----"
    cat "$logs/$name.out" >&2
  fi
done
((${#suites[@]} == 1)) || say "all suites done in $((SECONDS - started)) s, exit status $status"
exit "$status"
