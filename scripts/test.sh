#!/usr/bin/env bash
# Set up and run the whole test suite: unit tests on the tiny random pair, the Streamlit app headless and in a real
# browser (Debian's chromium, installed here when missing), and integration tests on the embedded real pair.
# Extra arguments go to pytest (e.g. -m "not real" to skip the real pair). Prints the wall time of each phase.
#   --fast   the fast tier: no real pair, no app, no browser, no GPU, no slow unit test (markers: pyproject.toml);
#            what a contributor runs first (a few minutes on 2 cores)
#   SPEC_EXPLORER_TEST_WORKERS=N   pytest-xdist workers (default: one a core, at most 4; 0 runs in this process)
set -euo pipefail
cd "$(dirname "$0")/.."
phase() { echo "[test.sh] $1: $(( SECONDS - t0 )) s"; t0=$SECONDS; }
# The tests share the cores as xdist workers (most use one thread: tests/conftest.py); tests that share a costly thing
# (the embedded pair, an app server) run on one worker (conftest's xdist groups).
workers() {
  local n=${SPEC_EXPLORER_TEST_WORKERS:-$(python -c "import os; print(min(4, len(os.sched_getaffinity(0))))")}
  [ "$n" -ge 2 ] && echo "$n" || echo 0
}
t0=$SECONDS
FAST=0
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then FAST=1; else args+=("$a"); fi
done
if [ $FAST = 1 ]; then
  . scripts/setup.sh requirements-dev.txt
  phase "python packages"
  status=0
  python -m pytest -q tests -n "$(workers)" --dist loadgroup -m "not (real or cuda or browser or app or slow)" \
    ${args[@]+"${args[@]}"} || status=$?
  phase "fast tier"
  exit $status
fi
if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null; } ||
    echo "WARNING: could not install Debian's chromium; the real-browser test will be skipped" >&2
fi
phase "chromium"
. scripts/setup.sh requirements-dev.txt
phase "python packages"
case " ${args[*]-} " in
  *"not real"*) ;;
  *) # assemble, check and convert the embedded pair once (a no-op when SPEC_EXPLORER_CACHE already holds it)
     python -c "from explorer.models.loading import prepare_default_pair; prepare_default_pair()"
     phase "embedded model pair" ;;
esac
status=0
python -m pytest -q tests -n "$(workers)" --dist loadgroup ${args[@]+"${args[@]}"} || status=$?
phase "test suite"
exit $status
