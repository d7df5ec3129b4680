"""Named runs (k8s/*.yaml RayJobs) against the chart's own RayJob: what a cluster checks at run
time (NetworkPolicies by label, Secrets by name, mounts by path) must agree, or a named job
waits forever (its submitter dropped on the way to the dashboard) or cannot read the store.

The reference is the chart rendered as the specs assume it is installed: release `r3flow`,
helm/r3flow/ci/production-values.yaml (mutual TLS, role tokens, the chart's trainer on).
"""

from __future__ import annotations

import pytest
import yaml
from conftest import API_VERSIONS, CHART, VALUES_FILES, find, run_helm

RELEASE = "r3flow"
NODE_TYPES = ("head", "worker")


@pytest.fixture(scope="module")
def chart_job(helm) -> tuple[list[dict], dict]:
    """(rendered documents, the chart's RayJob) of release `r3flow` with production values."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), *API_VERSIONS,
                    "-f", str(VALUES_FILES["production"]))
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return docs, find(docs, "RayJob")[0]


def _named_jobs(k8s_specs) -> list[tuple[str, dict]]:
    return [(name, job) for name, docs in k8s_specs.items() for job in find(docs, "RayJob")]


def _pods(job: dict) -> dict[str, tuple[dict, dict]]:
    """node type|submitter -> (pod spec, labels as KubeRay runs it)."""
    cluster = job["spec"]["rayClusterSpec"]
    out = {}
    for node_type, group in zip(NODE_TYPES, [cluster["headGroupSpec"],
                                             *cluster["workerGroupSpecs"][:1]], strict=True):
        labels = dict(group["template"]["metadata"]["labels"])
        labels["ray.io/node-type"] = node_type
        out[node_type] = (group["template"]["spec"], labels)
    sub = job["spec"].get("submitterPodTemplate")
    if sub:
        out["submitter"] = (sub["spec"], dict(sub["metadata"].get("labels") or {}))
    return out


def _selects(selector: dict, labels: dict) -> bool:
    return (selector.get("matchLabels") or {}).items() <= labels.items()


def _policy_view(policies: list[dict], labels: dict) -> set[tuple]:
    """How the NetworkPolicies treat a pod with `labels`: policies selecting it, and the
    in-namespace ingress peers (podSelector only) it matches, by policy name minus release."""
    view = set()
    for p in policies:
        name = p["metadata"]["name"].removeprefix(RELEASE)
        if _selects(p["spec"]["podSelector"], labels):
            view.add((name, "selected"))
        for i, rule in enumerate(p["spec"].get("ingress", [])):
            for j, peer in enumerate(rule.get("from", [])):
                if set(peer) == {"podSelector"} and _selects(peer["podSelector"], labels):
                    view.add((name, "peer", i, j))
    return view


def _secret_mounts(spec: dict) -> dict[str, tuple]:
    """mount path -> (Secret, items) of every Secret volume the first container mounts."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    out = {}
    for m in spec["containers"][0].get("volumeMounts", []):
        sec = vols[m["name"]].get("secret")
        if sec:
            items = tuple((i["key"], i["path"]) for i in sec.get("items", []))
            out[m["mountPath"]] = (sec["secretName"], items)
    return out


def _volume_kinds(spec: dict) -> dict[str, str]:
    """mount path -> volume source kind (configMap, persistentVolumeClaim, emptyDir, ...)."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: next(k for k in vols[m["name"]] if k != "name")
            for m in spec["containers"][0].get("volumeMounts", [])}


def test_every_named_spec_has_the_chart_submitter_labels(chart_job, k8s_specs):
    _, ref = chart_job
    want = ref["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    for name, job in _named_jobs(k8s_specs):
        sub = job["spec"].get("submitterPodTemplate")
        assert sub, f"{name}: no submitterPodTemplate: KubeRay's default submitter carries none " \
                    f"of the labels the release's NetworkPolicy admits to the dashboard (8265)"
        assert sub["metadata"]["labels"] == want, f"{name}: submitter labels differ from the chart's"


def test_named_pods_meet_the_network_policies_as_the_charts_do(chart_job, k8s_specs):
    docs, ref = chart_job
    policies = find(docs, "NetworkPolicy")
    ref_pods = _pods(ref)
    for name, job in _named_jobs(k8s_specs):
        for role, (_, labels) in _pods(job).items():
            want = _policy_view(policies, ref_pods[role][1])
            got = _policy_view(policies, labels)
            assert got == want, f"{name} {role}: NetworkPolicies see it as {sorted(got)}, the " \
                                f"chart's {role} as {sorted(want)}"


def test_named_pods_mount_the_charts_secrets_and_volumes(chart_job, k8s_specs):
    _, ref = chart_job
    ref_pods = _pods(ref)
    for name, job in _named_jobs(k8s_specs):
        for role, (spec, _) in _pods(job).items():
            ref_spec = ref_pods[role][0]
            assert _secret_mounts(spec) == _secret_mounts(ref_spec), f"{name} {role}: Secrets"
            assert spec["securityContext"] == ref_spec["securityContext"], f"{name} {role}"
            if role == "submitter":
                continue
            kinds = _volume_kinds(spec)
            for path in ("/etc/r3flow", "/tmp", "/checkpoints", "/models"):
                assert path in kinds, f"{name} {role}: nothing mounted at {path}"
            for path in ("/etc/r3flow", "/tmp"):
                assert kinds[path] == _volume_kinds(ref_spec)[path], f"{name} {role}: {path}"
            assert kinds["/checkpoints"] == "persistentVolumeClaim", \
                f"{name} {role}: checkpoints must outlive the Ray cluster (a PVC)"


def test_named_runs_use_the_charts_ports(chart_job, k8s_specs):
    docs, _ = chart_job
    ref = yaml.safe_load(find(docs, "ConfigMap", "-trainer")[0]["data"]["train.yaml"])
    for name, specs in k8s_specs.items():
        for cm in find(specs, "ConfigMap"):
            if "train.yaml" not in (cm.get("data") or {}):
                continue
            cfg = yaml.safe_load(cm["data"]["train.yaml"])
            assert cfg["run"]["metrics_port"] == ref["run"]["metrics_port"], name
            assert cfg["data"]["store"] == ref["data"]["store"], name


def _ray_auth_env(spec: dict) -> list[dict]:
    return [e for e in spec["containers"][0].get("env", []) if e["name"].startswith("RAY_AUTH")]


def test_every_ray_cluster_requires_the_token_and_the_submitter_has_it(chart_job, k8s_specs):
    docs, ref = chart_job
    auth = ref["spec"]["rayClusterSpec"]["authOptions"]
    assert auth["mode"] == "token"
    secret = find(docs, "Secret", "-ray-token")[0]
    assert secret["metadata"]["name"] == auth["secretName"] and "auth_token" in secret["data"]
    want_env = _ray_auth_env(ref["spec"]["submitterPodTemplate"]["spec"])
    assert {e["name"] for e in want_env} == {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
    for name, job in _named_jobs(k8s_specs):
        assert job["spec"]["rayClusterSpec"].get("authOptions") == auth, \
            f"{name}: rayClusterSpec.authOptions must be the release's {auth}"
        sub = job["spec"]["submitterPodTemplate"]["spec"]
        assert _ray_auth_env(sub) == want_env, f"{name}: the submitter cannot authenticate"
        for role, (spec, _) in _pods(job).items():
            if role != "submitter":  # KubeRay sets them from authOptions; a value here wins
                assert not _ray_auth_env(spec), f"{name} {role}: RAY_AUTH_* set by hand"
