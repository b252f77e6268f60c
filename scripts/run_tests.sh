#!/usr/bin/env bash
# Sets up the virtualenv (scripts/setup_env.sh) and runs the default test suite (slow tests excluded).
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -m slow` for the slow tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
exec "$VENV/bin/python" -m pytest "$@"
