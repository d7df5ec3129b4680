#!/usr/bin/env bash
# Stage vLLM for the lent H200s (issue 41; `make gpu-vllm-wheels`): resolve vllm for cp312
# manylinux x86_64 against the device image's versions, download what the image lacks, and cut
# it into parts of at most 52 MiB that one device call each can carry (<= 64 MiB with the repo).
#   .gpu/vllm/lock.txt       the resolver's full set (uv pip compile)
#   .gpu/vllm/staged.txt     the part of it that travels (the image has the rest)
#   .gpu/stage/N/part        part N of one tar of the wheels; .gpu/stage/N/MANIFEST (every part's
#                            sha256 and the tar's) travels with each part
# The device side: scripts/gpu_vllm_install.sh (BENCHMARKS.md "vLLM on the H200s" gives the calls).
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-.venv/bin/uv}
PY=${PY:-.venv/bin/python}
PART_MB=${PART_MB:-52}
# Left out: torch and the CUDA/NVIDIA libraries (the image's), and optional kernel wheels vLLM
# imports only when a feature asks for them (flashinfer-cubin alone is 447 MB).
SKIP_RE='^(torch|nvidia-.*|cuda-.*|flashinfer-cubin|tokenspeed-triton|tilelang|z3-solver)$'
out=.gpu/vllm
rm -rf "$out" .gpu/stage
mkdir -p "$out/wheels" .gpu/stage
"$UV" pip compile requirements/gpu-vllm.in -c requirements/gpu-vllm-constraints.txt \
  --override requirements/gpu-vllm-overrides.txt --python-version 3.12 \
  --python-platform x86_64-manylinux_2_35 --only-binary :all: --no-annotate --no-header \
  -q -o "$out/lock.txt"
"$PY" - "$out/lock.txt" requirements/gpu-image.txt "$SKIP_RE" >"$out/staged.txt" <<'PY'
import re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s.strip().lower())
image = {norm(l) for l in open(sys.argv[2]) if l.strip() and not l.startswith("#")}
skip = re.compile(sys.argv[3])
for line in open(sys.argv[1]):
    line = line.strip()
    if "==" not in line or line.startswith("#"):
        continue
    name = norm(line.split("==")[0])
    if name not in image and not skip.match(name):
        print(line)
PY
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform any -d "$out/wheels" -r "$out/staged.txt"
want=$(wc -l <"$out/staged.txt"); got=$(find "$out/wheels" -name '*.whl' | wc -l)
[ "$want" = "$got" ] || { echo "gpu_vllm_stage: $got wheels for $want packages" >&2; exit 1; }
tar -C "$out/wheels" -cf "$out/wheels.tar" .
split -b "${PART_MB}M" -d -a 1 "$out/wheels.tar" "$out/part."
n=0
for p in "$out"/part.*; do mkdir -p ".gpu/stage/$n"; mv "$p" ".gpu/stage/$n/part"; n=$((n + 1)); done
{
  echo "parts $n"
  echo "tar $(sha256sum "$out/wheels.tar" | cut -d' ' -f1)"
  for i in $(seq 0 $((n - 1))); do echo "part $i $(sha256sum ".gpu/stage/$i/part" | cut -d' ' -f1)"; done
} >"$out/MANIFEST"
for i in $(seq 0 $((n - 1))); do cp "$out/MANIFEST" ".gpu/stage/$i/MANIFEST"; done
rm "$out/wheels.tar"
echo "gpu_vllm_stage: $got wheels, $(du -sm "$out/wheels" | cut -f1) MiB in $n parts (.gpu/stage/0..$((n - 1)))"
