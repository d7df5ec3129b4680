#!/usr/bin/env bash
# Device side of the vLLM staging (issue 41; scripts/gpu_vllm_stage.sh makes the parts here).
# On the GPU machine, in a checkout holding .gpu/stage/N for each part (docs/gpu.md; the parts
# can come one at a time: the staged files under /tmp last as long as the machine does):
#   bash scripts/gpu_vllm_install.sh stage 0      # ... stage N-1, one part each
#   bash scripts/gpu_vllm_install.sh install
# `install` checks every part and the whole tar against MANIFEST (sha256), installs the wheels
# with pip --no-deps into /tmp/vllm-site and prints the vLLM, torch and NCCL versions.
# Later calls on the same machine: `source scripts/gpu_vllm_install.sh env` (PYTHONPATH, NCCL).
set -uo pipefail
STAGE=/tmp/vllm-stage SITE=/tmp/vllm-site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
vllm_env() { export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}; }
versions() {
  python3 - <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
PY
}
want_sha() { awk -v k="$1" -v i="${2:-}" '$1 == k && (i == "" || $2 == i) {print $NF}' "$STAGE/MANIFEST"; }
stage() {
  local n=$1 src=.gpu/stage/$1
  [ -f "$src/part" ] || { echo "gpu_vllm_install: $src/part is missing (carry it)"; return 1; }
  mkdir -p "$STAGE" && cp "$src/MANIFEST" "$STAGE/MANIFEST" && cp "$src/part" "$STAGE/part.$n"
  local got; got=$(sha256sum "$STAGE/part.$n" | cut -d' ' -f1)
  [ "$got" = "$(want_sha part "$n")" ] || { echo "gpu_vllm_install: part $n sha256 $got differs from MANIFEST"; return 1; }
  echo "part $n staged ($(du -m "$STAGE/part.$n" | cut -f1) MiB, sha256 ok); /tmp holds: $(ls "$STAGE" | tr '\n' ' ')"
}
install() {
  local parts; parts=$(want_sha parts)
  for i in $(seq 0 $((parts - 1))); do
    [ -f "$STAGE/part.$i" ] || { echo "gpu_vllm_install: part $i of $parts is not staged (the machine was given back in between?)"; return 1; }
  done
  local got; got=$(for i in $(seq 0 $((parts - 1))); do cat "$STAGE/part.$i"; done | tee "$STAGE/wheels.tar" | sha256sum | cut -d' ' -f1)
  [ "$got" = "$(want_sha tar)" ] || { echo "gpu_vllm_install: assembled tar sha256 $got differs from MANIFEST"; return 1; }
  rm -rf "$STAGE/wheels" && mkdir -p "$STAGE/wheels" && tar -C "$STAGE/wheels" -xf "$STAGE/wheels.tar" || return 1
  echo "tar sha256 ok: $(ls "$STAGE"/wheels/*.whl | wc -l) wheels; installing into $SITE"
  python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$SITE" \
    "$STAGE"/wheels/*.whl 2>&1 | grep -v -i "warning: target directory" || true
  vllm_env && versions
}
case ${1:-} in
  env) vllm_env;;
  *)
    while [ $# -gt 0 ]; do
      case $1 in
        stage) stage "$2" || exit 1; shift 2;;
        install) install || exit 1; shift;;
        versions) vllm_env; versions || exit 1; shift;;
        *) echo "gpu_vllm_install.sh: unknown step $1 (stage N | install | versions | env)"; exit 2;;
      esac
    done;;
esac
