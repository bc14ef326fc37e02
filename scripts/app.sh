#!/usr/bin/env bash
# Set up (first run: installs packages and the 1.6 GB embedded model pair) and start the app on
# http://localhost:8501 with the default model pair. Extra arguments go to `streamlit run`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh requirements.txt
exec python -m streamlit run app.py "$@"
