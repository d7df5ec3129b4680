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


def _gpu_workers(job: dict) -> list[dict]:
    return [g for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
            if any("nvidia.com/gpu" in (c.get("resources", {}).get("limits") or {})
                   for c in g["template"]["spec"]["containers"])]


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_named_gpu_runs_request_the_charts_fast_network(chart_job, k8s_specs):
    """NCCL over IB (NCCL_IB_DISABLE=0) needs the RDMA device plugin's resource and IPC_LOCK,
    as the chart's workers get them from fastNetwork (production values); without them the
    cross-node traffic and the weight push fall back to TCP."""
    _, ref = chart_job
    ref_c = _gpu_workers(ref)[0]["template"]["spec"]["containers"][0]
    rdma = {k: v for k, v in ref_c["resources"]["limits"].items() if k.startswith("rdma/")}
    assert rdma, "production values request no RDMA resource"
    caps = ref_c["securityContext"]["capabilities"].get("add")
    assert caps == ["IPC_LOCK"]
    for name, job in _named_jobs(k8s_specs):
        for g in _gpu_workers(job):
            for c in g["template"]["spec"]["containers"]:
                env = _env(c)
                if env.get("NCCL_IB_DISABLE") != "0":
                    continue
                for kind in ("requests", "limits"):
                    got = {k: v for k, v in c["resources"][kind].items() if k.startswith("rdma/")}
                    assert got == rdma, f"{name} {g['groupName']}: {kind} {got}, chart {rdma}"
                assert c["securityContext"]["capabilities"].get("add") == caps, \
                    f"{name} {g['groupName']}: NCCL over IB without IPC_LOCK"
                for k, v in _env(ref_c).items():
                    if k.startswith("NCCL_IB"):
                        assert env.get(k) == v, f"{name} {g['groupName']}: {k}"


TINY_GRACE_S = 60  # a CPU smoke run's step + checkpoint, with room on a loaded node


def test_named_runs_retry_and_stop_like_the_chart(chart_job, k8s_specs):
    """backoffLimit > 0 (KubeRay's 0 ends a week-long job at the first lost rank) and a grace
    period set on every Ray pod, at least the chart's trainer.terminationGracePeriodSeconds (the
    trainer's SIGTERM path finishes its step and checkpoints; Kubernetes' default is 30 s), or
    TINY_GRACE_S for the CPU smoke specs."""
    _, ref = chart_job
    assert ref["spec"]["backoffLimit"] > 0
    grace = ref["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"][
        "terminationGracePeriodSeconds"]
    for name, job in [("chart", ref), *_named_jobs(k8s_specs)]:
        # CPU smoke runs of tests/cluster (seconds a step, killed on purpose): no retry, and a
        # grace period of their own that still covers a step and a checkpoint
        tiny = name.startswith("tiny-")
        assert tiny or job["spec"].get("backoffLimit", 0) > 0, f"{name}: backoffLimit"
        for role, (spec, _) in _pods(job).items():
            if role != "submitter":
                got, need = spec.get("terminationGracePeriodSeconds"), TINY_GRACE_S if tiny else grace
                assert got is not None and got >= need, \
                    f"{name} {role}: terminationGracePeriodSeconds {got} (needs >= {need})"


def test_named_runs_get_the_charts_pdb(helm, k8s_specs):
    """A release without its own trainer (the named runs' install) still makes the trainer PDB,
    and it selects every named run's Ray pods (docs/operations.md promises it)."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), *API_VERSIONS,
                    "-f", str(VALUES_FILES["production"]), "--set", "trainer.enabled=false")
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    pdbs = [p for p in find(docs, "PodDisruptionBudget", "-trainer")]
    assert len(pdbs) == 1 and pdbs[0]["spec"]["maxUnavailable"] == 0
    for name, job in _named_jobs(k8s_specs):
        if name.startswith("tiny-"):
            continue
        for role in NODE_TYPES:
            labels = _pods(job)[role][1]
            assert _selects(pdbs[0]["spec"]["selector"], labels), f"{name} {role}: no PDB"


def test_named_runs_use_the_charts_image_and_staleness(chart_job, k8s_specs, helm):
    """Images: the trainer image the chart renders with its default registry and version (one
    registry, checked here); data.max_policy_lag: the release store's (production values)."""
    proc = run_helm(helm, "template", RELEASE, str(CHART), *API_VERSIONS,
                    "--set", "trainer.enabled=true")
    assert proc.returncode == 0, proc.stderr
    job = find([d for d in yaml.safe_load_all(proc.stdout) if d], "RayJob")[0]
    image = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "image"]
    docs, _ = chart_job
    store = yaml.safe_load(find(docs, "ConfigMap", "-store")[0]["data"]["store.yaml"])
    for name, specs in k8s_specs.items():
        if name.startswith("tiny-"):
            continue
        for job in find(specs, "RayJob"):
            for role, (spec, _) in _pods(job).items():
                for c in spec["containers"]:
                    assert c["image"] == image, f"{name} {role}: image {c['image']}, chart {image}"
        for cm in find(specs, "ConfigMap"):
            cfg = yaml.safe_load((cm.get("data") or {}).get("train.yaml") or "null")
            if cfg:
                assert cfg["data"].get("max_policy_lag") == store["max_policy_lag"], \
                    f"{name}: data.max_policy_lag {cfg['data'].get('max_policy_lag')}, the " \
                    f"store's {store['max_policy_lag']}"
