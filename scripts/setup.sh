#!/usr/bin/env bash
# Create .venv (if missing), install the pinned requirements into it, and the package itself in editable mode (the
# console script .venv/bin/spec-explorer; pyproject.toml). Sourced by app.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --disable-pip-version-check -r "${1:-requirements.txt}"
if [ ! -x .venv/bin/spec-explorer ]; then
  python -m pip install -q --disable-pip-version-check --no-deps -e .
fi
