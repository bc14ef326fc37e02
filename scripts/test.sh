#!/usr/bin/env bash
# Set up and run the whole test suite: unit tests on the tiny random pair, the Streamlit app headless and in a real
# browser (Debian's chromium, installed here when missing), and integration tests on the embedded real pair.
# Extra arguments go to pytest (e.g. -m "not real" to skip the real pair).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } ||
    echo "WARNING: could not install Debian's chromium; the real-browser test will be skipped" >&2
fi
. scripts/setup.sh requirements-dev.txt
exec python -m pytest -q tests "$@"
