#!/usr/bin/env bash
# The interpreter the project's scripts run: $PYTHON, else the active virtual environment's,
# else $VENV's (./.venv unless VENV names another folder; made by tools/install_cpu.sh), else
# python3.
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
[[ "$venv" == /* ]] || venv="$PWD/$venv"
if [[ -n "${PYTHON:-}" ]]; then
  echo "$PYTHON"
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
  echo "$VIRTUAL_ENV/bin/python"
elif [[ -x "$venv/bin/python" || "${1:-}" == --for-install ]]; then
  echo "$venv/bin/python"
else
  echo python3
fi
