#!/usr/bin/env bash
# The full test suite: stubs up to date, unit + integration tests, offline chart checks.
set -euo pipefail
PY=.venv/bin/python
"$PY" -m pytest tests/unit tests/integration tests/faults -q -m "not gpu" --timeout=900 -p no:cacheprovider
if [ -f scripts/chart_check.sh ]; then
  bash scripts/chart_check.sh
fi
