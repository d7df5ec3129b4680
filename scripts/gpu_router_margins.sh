#!/usr/bin/env bash
# Issue 57 item 4 on one H200 with vLLM staged (scripts/gpu_vllm_install.sh): the GPU model's bf16
# engine-vs-trainer routing with the margin recipe and without (tests/bench/bench_router_margins.py
# on configs/local-gpu-h200.yaml): each arm builds and warm-starts the 0.73 B model as `r3flow
# local` does, samples PROMPTS rollouts with vLLM (eager, bf16, routed experts) and scores them
# with the megatron trainer in bf16. The two arms run side by side (UTIL of the GPU each).
#   OUT=DIR WHEELS=.gpu/local-wheels bash scripts/gpu_router_margins.sh
# $OUT gets recipe.json, baseline.json, each arm's log and table.txt; the models stay in /tmp.
set -uo pipefail
OUT=${OUT:-bench-results/router-margins} WHEELS=${WHEELS:-.gpu/local-wheels}
LIMIT=${LIMIT:-110} UTIL=${UTIL:-0.3} PROMPTS=${PROMPTS:-64} WORK=${WORK:-/tmp/r3flow-margins}
CONFIG=${CONFIG:-configs/local-gpu-h200.yaml}
mkdir -p "$OUT"
source scripts/gpu_vllm_install.sh env
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
export PYTHONPATH=/tmp/local-site:$PYTHONPATH
[ -d /tmp/local-site/megatron ] || python3 -m pip install -q --no-deps --no-index --no-compile \
  --target /tmp/local-site "$WHEELS"/*.whl 2>&1 | grep -v -i "warning: target directory"
python3 -m services.common._build >/dev/null
echo "== $(date -u +%T) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1)"
for arm in baseline recipe; do
  timeout -k 5 "$LIMIT" python3 tests/bench/bench_router_margins.py --config "$CONFIG" \
    --arm "$arm" --util "$UTIL" --prompts "$PROMPTS" --out "$OUT" --work "$WORK" \
    >"$OUT/$arm.log" 2>&1 &
  sleep "${STAGGER_S:-10}"  # the engines start one after the other (each measures free memory)
done
wait
grep -ho "\[aux.*\|[A-Za-z]*Error.*" "$OUT"/*.log | tail -n 20
python3 tests/bench/bench_router_margins.py --table --out "$OUT" | tee "$OUT/table.txt"
