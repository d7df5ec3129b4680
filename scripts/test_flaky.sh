#!/usr/bin/env bash
# Reruns named tests N times in a row, each time in a fresh pytest process, and stops at the
# first failure: `TESTS="tests/a.py::test_b tests/c.py::test_d" N=10 make test-flaky`.
# A flake fix is shown by N passes in a row; the failing run's output is printed whole.
set -uo pipefail
PY=.venv/bin/python
TESTS=${TESTS:?"name the tests: TESTS=\"path::test ...\" N=10 make test-flaky"}
N=${N:-10}
[[ "$N" =~ ^[1-9][0-9]*$ ]] || { echo "test-flaky: N must be a positive count, got '$N'" >&2; exit 2; }
read -ra names <<< "$TESTS"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for ((i = 1; i <= N; i++)); do
  start=$SECONDS
  if "$PY" -m pytest "${names[@]}" -q -p no:cacheprovider -m "not gpu" --timeout=900 \
      ${PYTEST_ARGS:-} > "$log" 2>&1; then
    echo "test-flaky: run $i/$N passed in $((SECONDS - start)) s ($(tail -n 1 "$log" | tr -d '='))"
  else
    cat "$log"
    echo "test-flaky: run $i/$N FAILED after $((i - 1)) passes in a row" >&2
    exit 1
  fi
done
echo "test-flaky: $N/$N passed in a row: $TESTS"
