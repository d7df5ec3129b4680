#!/usr/bin/env bash
# Debian's `prometheus` package (prometheus + promtool) for `make test`: promtool checks the
# chart's rules, and `r3flow local` runs a real Prometheus on loopback when the binary is on the
# PATH. The package starts a system Prometheus on :9090; it is stopped at once (tests start
# their own, on loopback, by pid).
set -euo pipefail
command -v prometheus >/dev/null && command -v promtool >/dev/null && exit 0
echo "[setup] installing Prometheus (Debian package prometheus)"
command -v apt-get >/dev/null || { echo "prometheus missing and apt-get unavailable" >&2; exit 1; }
{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends prometheus; } >/dev/null 2>&1 \
  || { echo "apt-get install prometheus failed (needs root and the Debian mirror)" >&2; exit 1; }
{ systemctl stop prometheus || service prometheus stop; } >/dev/null 2>&1 || true
