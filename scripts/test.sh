#!/usr/bin/env bash
# The full test suite: lint, stubs up to date, unit + integration tests, offline chart checks.
set -euo pipefail
PY=.venv/bin/python
# Lint first, so it cannot rot: ruff, then mypy (the same as `make lint`).
.venv/bin/ruff check services trainer tests
.venv/bin/mypy services trainer
# A real Prometheus for the local-run test (and promtool for the chart checks).
bash scripts/install_prometheus.sh
# The chart tools' venv (checkov, helm, ...; minutes on a fresh clone) installs beside pytest.
TOOLS_LOG=$(mktemp)
bash scripts/chart_check.sh --install > "$TOOLS_LOG" 2>&1 &
TOOLS_PID=$!
trap 'kill "$TOOLS_PID" 2>/dev/null || true' EXIT  # pytest failed: stop the install too
"$PY" -m pytest tests/unit tests/integration tests/faults -q -m "not gpu and not manual" --timeout=900 -p no:cacheprovider --durations=40
if ! wait "$TOOLS_PID"; then
  cat "$TOOLS_LOG"; echo "test.sh: the chart tools' install failed (above)" >&2; exit 1
fi
trap - EXIT
cat "$TOOLS_LOG"; rm -f "$TOOLS_LOG"
bash scripts/chart_check.sh
