#!/usr/bin/env bash
# The full test suite: lint, stubs up to date, unit + integration tests, offline chart checks.
set -euo pipefail
PY=.venv/bin/python
# Lint first, so it cannot rot: ruff, then mypy (the same as `make lint`).
.venv/bin/ruff check services trainer tests
.venv/bin/mypy services trainer
# A real Prometheus for the local-run test (and promtool for the chart checks).
bash scripts/install_prometheus.sh
"$PY" -m pytest tests/unit tests/integration tests/faults -q -m "not gpu and not manual" --timeout=900 -p no:cacheprovider --durations=40
if [ -f scripts/chart_check.sh ]; then
  bash scripts/chart_check.sh
fi
