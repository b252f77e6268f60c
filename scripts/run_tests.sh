#!/usr/bin/env bash
# Sets up the virtualenv (scripts/setup_env.sh), runs the linter (ruff) and the default test suite (slow tests
# excluded).
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -m slow` for the slow tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
VENV=${VENV:-.venv}
# The linter first (ruff.toml: pyflakes, import order, bugbear, line length): a second, not a test run.
"$VENV/bin/ruff" check .
if [ "$#" -eq 0 ]; then
  set -- -m "not slow"
fi
exec "$VENV/bin/python" -m pytest "$@"
