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
# The chart checks (their tools' venv first: checkov, helm, ...; minutes on a fresh clone) run
# beside pytest, at the lowest priority too: they take the cycles pytest leaves idle (its
# sleeps and waits, the last worker's tail) and the registry waits of the image resolves, so
# that their ~75 s no longer follow pytest (issue 43). Nothing in them depends on pytest.
# Its ports (tests/chart/test_store_smoke.py binds some) lie above the kernel's ephemeral
# range, apart from both xdist workers' shares below it (tests/conftest.py).
CHART_ENV=()
read -r _ eph_hi < /proc/sys/net/ipv4/ip_local_port_range || eph_hi=65535
[ "$eph_hi" -lt 65000 ] && CHART_ENV=(R3FLOW_PORT_RANGE="$((eph_hi + 1))-65535")
CHART_LOG=$(mktemp)
chart_start=$SECONDS
( env "${CHART_ENV[@]}" nice -n 19 bash scripts/chart_check.sh > "$CHART_LOG" 2>&1 & c=$!
  trap 'kill "$c" 2>/dev/null; exit 143' TERM  # test.sh stopped early: stop it too
  rc=0; wait "$c" || rc=$?
  echo "test.sh: chart-check done $((SECONDS - chart_start)) s after it started" >> "$CHART_LOG"
  exit "$rc" ) &
CHART_PID=$!
trap 'kill "$CHART_PID" "$MYPY_PID" 2>/dev/null || true' EXIT  # pytest failed: stop them too
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
stage=$SECONDS
chart_rc=0; wait "$CHART_PID" || chart_rc=$?
trap - EXIT
cat "$CHART_LOG"; rm -f "$CHART_LOG"
echo "test.sh: chart-check finished $((SECONDS - stage)) s after pytest and mypy"
[ "$chart_rc" = 0 ] || { echo "test.sh: chart-check failed (above)" >&2; exit 1; }
