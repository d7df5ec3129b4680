#!/usr/bin/env bash
# Everything r3flow measures on a GPU machine, in one call (docs/gpu.md), in a checkout that holds
# .gpu/ (`make gpu-wheels`):
#   bash scripts/gpu_run.sh
# or some sections only: `bash scripts/gpu_run.sh parallel` (trainer | parallel | bench | hf |
# push | weights | cpu | fastpath | fastpath-tests; the default runs all but bench, hf, push, cpu
# and the fastpath ones).
# fastpath: issue 30's kernels probe and the plain vs fast path bench (LAYOUTS="--ep=4;--ep=4 --tp=2",
# layouts separated by ';';
# FASTPATH_PATHS="fast fast_pg fast_pg_step fast_unplanned fast_prof fast_mb1 fast_mb4
# fast_norecompute fast_torchlp fast_bfl fast_gather plain" adds the fast path with --overlap-param-gather, with the
# gathers started at the step's end, without the planned dispatch, profiled, with micro-batch 1
# or 4 (2 in fast), without MoE recompute, with the chunked torch log-softmax instead of the
# Triton kernels (loss.logprob_kernel, issue 44), without megatron's [S, B, V] -> [B, S, V] copy
# of the logits (fast_bfl: model.batch_first_logits on, issue 44; measured in issue 55: auto now),
# with the gather-based MoE permute (fast_gather: model.moe_permute gather, issue 55); the bench
# runs `r3flow plan`'s recompute pick for the GPU unless FAST or the path names
# --[no-]recompute-moe;
# PROBE=0 skips the kernel probe; `none`: only the wheels' install and the build);
# fastpath-tests: tests/gpu with the fast path's model switches (R3FLOW_GPU_MODEL), one line per test
# as it ends (the pytest files under $OUT grow as tests end: a run cut by a timeout keeps them).
# hf: the HF/FSDP2 backend at Qwen3-30B-A3B widths (issue 31; needs transformers and its
# dependencies as cp312 wheels in .gpu/hf-wheels, e.g. `pip download --no-deps` of the versions
# in requirements/cpu.lock; HF_ROUNDS timed rounds, default 2).
# `cpu` is the host CPU's codec and weight-push
# benches (issue 16; no GPU; bench-codec needs zstandard from .gpu/wheels):
# CPU_AB="stores:bucket_mb:inflight ..." picks the push variants (default stream:64:2), each
# run pinned to 2 cores and unpinned, the list twice (alternating).
# There: Python 3.12 + torch 2.11, nothing installable. `.gpu/wheels` (gitignored, made by
# `make gpu-wheels`) carries megatron-core and the few pure/cp312 packages the image lacks.
set -uo pipefail
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT" bench-results
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=/tmp/pylib:$PWD
# SETUP=0: the wheels are installed and the build made (a section run beside another one)
if [ "${SETUP:-1}" = 1 ]; then
  if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/pylib .gpu/wheels/*.whl
  fi
  if compgen -G ".gpu/hf-wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/pylib .gpu/hf-wheels/*.whl
  fi
  nvidia-smi -L | tee "$OUT/gpus.txt"
  python3 -m services.common._build
fi
SECTIONS=${*:-trainer parallel weights}
for section in $SECTIONS; do
  case $section in
    trainer)
      echo "== pytest -m gpu (trainer: 1 GPU, 2 GPUs EP=2)"
      python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider -o addopts="" --timeout=900 \
        --ignore=tests/gpu/test_trainer_parallel_gpu.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -40;;
    parallel)
      echo "== pytest -m gpu: megatron parallel layouts with replay (issue 21; 4 GPUs, 2 at least)"
      python3 -m pytest tests/gpu/test_trainer_parallel_gpu.py -m gpu -q -rs -p no:cacheprovider \
        -o addopts="" --timeout=900 2>&1 | tee "$OUT/pytest_parallel_gpu.txt" | tail -60;;
    bench)
      echo "== megatron at Qwen3-30B-A3B widths, 8 layers, 4K tokens: EP4 and TP2(SP) x EP4"
      for layout in "--ep 4" "--ep 4 --tp 2"; do
        python3 tests/bench/bench_megatron_parallel.py --gpus "$(nvidia-smi -L | wc -l)" \
          --layers 8 $layout --out "bench-results/megatron_parallel_${layout//[ -]/}.json" 2>&1 \
          | grep -v -i "warn\|deprecated\|mimomodel\|return func" | tail -8
      done | tee "$OUT/bench_megatron_parallel.txt";;
    fastpath)
      # issue 30: the kernels, then the plain path (the issue's baseline: agreement check off)
      # and the fast path (agreement check on) in the same call; LAYOUTS picks the layouts
      if [ "${PROBE:-1}" = 1 ]; then
        echo "== fast-path kernels"
        python3 tests/bench/probe_fastpath.py 2>&1 | grep -v -i "warn" | tee "$OUT/probe_fastpath.txt"
      fi
      # (the overlapped parameter gather measured slower on 4 x H200: fast_pg adds it)
      # the reference flags; both of a rank's samples in one micro-batch (fast_mb1: one each)
      FAST="--experts grouped --attention sdpa --overlap-grad-reduce --fused-adam --chunked-logprobs --check-agreement --planned-dispatch --micro-batch 2"
      IFS=';' read -ra layouts <<<"${LAYOUTS:---ep=4;--ep=4 --tp=2}"
      for layout in "${layouts[@]}"; do
        for path in ${FASTPATH_PATHS:-fast plain}; do  # fast_pg: fast + param gather overlap
          case $path in fast) flags=$FAST;; fast_pg) flags="$FAST --overlap-param-gather";;
            fast_pg_step) flags="$FAST --overlap-param-gather --param-gather-dispatch step";;
            fast_unplanned) flags=${FAST/ --planned-dispatch/};;  # per-layer split-size syncs
            fast_mb1) flags=${FAST/ --micro-batch 2/};;
            fast_prof) flags="$FAST --profile";;  # + one off and one r3 step profiled
            fast_mb4) flags="${FAST/ --micro-batch 2/} --micro-batch 4";;
            fast_norecompute) flags="$FAST --no-recompute-moe";;
            fast_torchlp) flags="$FAST --logprob-kernel torch";;  # the chunked torch loss (before issue 44)
            fast_bfl) flags="$FAST --batch-first-logits";;  # no logits copy (model.batch_first_logits, issue 44)
            fast_gather) flags="$FAST --moe-permute gather";;  # gathers, no atomics (issue 55)
            *) flags="";; esac
          echo "== bench $layout $path"
          python3 tests/bench/bench_megatron_parallel.py --gpus "$(nvidia-smi -L | wc -l)" \
            --layers 8 $layout $flags --out "bench-results/fastpath_${layout//[ =-]/}_$path.json" \
            2>&1 | grep -v -i "warn\|deprecated\|mimomodel\|return func" | tail -${TAIL:-7}
        done
      done | tee "$OUT/bench_fastpath.txt";;
    fastpath-tests)
      echo "== pytest -m gpu with the fast path (grouped experts, sdpa, planned dispatch)"
      export R3FLOW_GPU_MODEL='{"experts": "grouped", "attention": "sdpa", "planned_dispatch": true}'
      python3 -m pytest tests/gpu -m gpu -v -rs -p no:cacheprovider -o addopts="" --timeout=900 \
        --durations=0 2>&1 | tee "$OUT/pytest_gpu_fastpath.txt" | tail -40;;
    hf)
      echo "== hf/FSDP2 at Qwen3-30B-A3B widths, 8 layers, 4K tokens, full sharding (issue 31)"
      OMP_NUM_THREADS=4 python3 tests/bench/bench_hf_parallel.py --gpus "$(nvidia-smi -L | wc -l)" \
        --layers 8 --rounds "${HF_ROUNDS:-2}" --out bench-results/hf_parallel.json 2>&1 \
        | grep -v -i "warn\|deprecat\|return func\|Writing model" \
        | tee "$OUT/bench_hf_parallel.txt" | tail -40;;
    push)
      # issue 29: the streamed push at Qwen3-30B-A3B size, 48 layers (4 GPUs; transformers from
      # .gpu/hf-wheels for the receivers' HF model): the sender taking whole chunks (packed),
      # EP2 and PP2, then tensor by tensor (the path before), EP2; raw NCCL in each run
      for mode in "packed --layout ep2 --layout pp2" "tensors --layout ep2"; do
        echo "== bench_push_stream --mode $mode"
        timeout 400 python3 tests/bench/bench_push_stream.py --mode $mode \
          --out "$OUT/push_stream_${mode%% *}.json" 2>&1 \
          | grep -v -i "warn\|deprecated\|mimomodel\|return func" | tail -6
      done | tee "$OUT/bench_push_stream.txt";;
    weights)
      echo "== bench-weights --device cuda"
      python3 tests/bench/bench_weights.py --device cuda 2>&1 | tail -30 \
        | tee "$OUT/bench_weights_cuda.txt";;
    cpu)
      echo "== host CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs, load $(cut -d' ' -f1 /proc/loadavg)"
      echo "== bench-codec (one core)"
      taskset -c 0 python3 tests/bench/bench_codec.py --repeats 5 --out "$OUT/codec.json" 2>&1 \
        | tail -14 | tee "$OUT/bench_codec.txt"
      for round in 1 2; do
        for variant in ${CPU_AB:-stream:64:2}; do
          IFS=: read -r stores mb inflight <<<"$variant"
          for cores in 0,1 all; do
            pin=(); [ "$cores" = all ] || pin=(taskset -c "$cores")
            echo "== bench-weights round $round, stores $stores, bucket $mb MiB, inflight $inflight, cores $cores" \
              | tee -a "$OUT/bench_weights_cpu.txt"
            "${pin[@]}" python3 tests/bench/bench_weights.py --repeats "${REPEATS:-9}" \
              --pack-stores "$stores" --bucket-mb "$mb" --inflight "$inflight" \
              --out "$OUT/weights_${stores}_${mb}_${inflight}_${cores/,/}_$round.json" 2>&1 \
              | grep -E "^raw|^Weight|steps|passes|CPU ms|ratio|verified" | tee -a "$OUT/bench_weights_cpu.txt"
          done
        done
      done;;
    none) ;;
    *) echo "gpu_run.sh: unknown section $section (trainer | parallel | bench | hf | weights | cpu | fastpath | fastpath-tests)"; exit 2;;
  esac
done
cp bench-results/*.json bench-results/*.txt "$OUT/" 2>/dev/null
ls -la "$OUT"
