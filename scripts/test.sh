#!/usr/bin/env bash
# The full test suite: lint, stubs up to date, unit + integration tests, offline chart checks.
set -euo pipefail
PY=.venv/bin/python
# Lint, so it cannot rot (the same as `make lint`): ruff first (a second), then mypy (~90 s of
# one core on a fresh clone) in the background beside the tests, at the lowest priority so that
# it takes only a core the tests leave idle; its errors print as soon as it fails, and make test
# fails at the end.
.venv/bin/ruff check services trainer tests
MYPY_LOG=$(mktemp)
( nice -n 19 .venv/bin/mypy services trainer > "$MYPY_LOG" 2>&1 & m=$!
  trap 'kill "$m" 2>/dev/null; exit 143' TERM  # test.sh stopped early: stop mypy too
  wait "$m" || { cat "$MYPY_LOG"; echo "test.sh: mypy failed (above)" >&2; exit 1; } ) &
MYPY_PID=$!
trap 'kill "$MYPY_PID" 2>/dev/null || true' EXIT
# A real Prometheus for the local-run test (and promtool for the chart checks).
bash scripts/install_prometheus.sh
# The chart tools' venv (checkov, helm, ...; minutes on a fresh clone) installs beside pytest,
# at the lowest priority too (needed only after it).
TOOLS_LOG=$(mktemp)
nice -n 19 bash scripts/chart_check.sh --install > "$TOOLS_LOG" 2>&1 &
TOOLS_PID=$!
trap 'kill "$TOOLS_PID" "$MYPY_PID" 2>/dev/null || true' EXIT  # pytest failed: stop them too
# Two pytest-xdist workers, one per core, each test file (or the files sharing a session fixture)
# whole on one worker, longest first (tests/conftest.py). PYTEST_WORKERS=0: one process, as before.
WORKERS=${PYTEST_WORKERS:-2}
XDIST=()
[ "$WORKERS" = 0 ] || XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
stage=$SECONDS
"$PY" -m pytest tests/unit tests/integration tests/faults -q -m "not gpu and not manual" --timeout=900 -p no:cacheprovider --durations=20 "${XDIST[@]}"
echo "test.sh: pytest $((SECONDS - stage)) s"
stage=$SECONDS
wait "$MYPY_PID" || { echo "test.sh: mypy failed (its errors are above)" >&2; exit 1; }
echo "test.sh: mypy finished $((SECONDS - stage)) s after pytest"
cat "$MYPY_LOG"; rm -f "$MYPY_LOG"
if ! wait "$TOOLS_PID"; then
  cat "$TOOLS_LOG"; echo "test.sh: the chart tools' install failed (above)" >&2; exit 1
fi
trap - EXIT
cat "$TOOLS_LOG"; rm -f "$TOOLS_LOG"
stage=$SECONDS
bash scripts/chart_check.sh
echo "test.sh: chart-check $((SECONDS - stage)) s"
