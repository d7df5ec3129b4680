"""What the Kubernetes control plane would make of rendered YAML, without one: pods from
StatefulSets/Deployments/RayJobs (KubeRay's `ray start` commands, env and submitter), each
container's command/args/env with Secrets, ConfigMaps and the downward API resolved, Services as
name -> pod IPs, and NetworkPolicies as per-pod nftables ingress rules.

Only the fields the chart and the RayJob specs use are read; anything else is ignored (the offline
schema checks of `make chart-check` cover the rest). KubeRay's behaviour follows
ray-operator/controllers/ray/common/pod.go and job.go (v1.7): see docs/cluster-test.md.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from dataclasses import dataclass, field

import yaml

DASHBOARD_PORT, GCS_PORT, METRICS_PORT, AGENT_PORT = 8265, 6379, 8080, 52365
# Every object lives in the release's namespace: `kubectl -n r3flow apply` / `helm install -n
# r3flow` put those that name none there (the chart's own objects name none).
NAMESPACE = "r3flow"


@dataclass
class Pod:
    """One pod: its labels, its (main) container and init containers, volumes, address."""

    name: str
    labels: dict
    spec: dict
    container: dict
    kind: str  # "app" | "ray-head" | "ray-worker" | "submitter"
    ip: str = ""
    ports: dict = field(default_factory=dict)  # containerPort name -> number
    extra_env: dict = field(default_factory=dict)  # what the operator injects

    @property
    def init_containers(self) -> list[dict]:
        return list(self.spec.get("initContainers") or [])


def load_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


class Objects:
    """Rendered objects by kind and name."""

    def __init__(self, docs: list[dict]) -> None:
        self.docs = docs

    def of(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d.get("kind") == kind]

    def get(self, kind: str, name: str) -> dict:
        for d in self.of(kind):
            if d["metadata"]["name"] == name:
                return d
        raise KeyError(f"{kind}/{name} is not among the rendered objects")

    def secret(self, name: str) -> dict[str, bytes]:
        s = self.get("Secret", name)
        out = {k: base64.b64decode(v) for k, v in (s.get("data") or {}).items()}
        out.update({k: str(v).encode() for k, v in (s.get("stringData") or {}).items()})
        return out

    def config_map(self, name: str) -> dict[str, bytes]:
        return {k: str(v).encode() for k, v in (self.get("ConfigMap", name).get("data") or {}).items()}


def _ports(container: dict) -> dict:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports") or []
            if "name" in p}


def workload_pods(objs: Objects) -> list[Pod]:
    """Pods of the StatefulSets (name-0, name-1, ...) and Deployments (name-<n>)."""
    pods = []
    for kind in ("StatefulSet", "Deployment"):
        for w in objs.of(kind):
            t = w["spec"]["template"]
            for i in range(int(w["spec"].get("replicas", 1))):
                c = t["spec"]["containers"][0]
                pods.append(Pod(f"{w['metadata']['name']}-{i}", dict(t["metadata"]["labels"]),
                                t["spec"], c, "app", ports=_ports(c)))
    return pods


def _ray_start(params: dict, head: bool, container: dict) -> str:
    """KubeRay's generated `ray start` (pod.go: setMissingRayStartParams,
    generateRayStartCommand): num-cpus/memory from the limits, --block, the defaults."""
    p = {k: str(v) for k, v in params.items()}
    if head:
        p.setdefault("dashboard-host", "0.0.0.0")
    p.setdefault("metrics-export-port", str(METRICS_PORT))
    p["block"] = "true"
    p.setdefault("dashboard-agent-listen-port", str(AGENT_PORT))
    limits = (container.get("resources") or {}).get("limits") or {}
    if "num-cpus" not in p and "cpu" in limits:
        p["num-cpus"] = str(int(float(str(limits["cpu"]).rstrip("m")) /
                                (1000 if str(limits["cpu"]).endswith("m") else 1)))
    if "memory" not in p and "memory" in limits:
        p["memory"] = str(_quantity(str(limits["memory"])))
    flags = " ".join(f"--{k}" if v == "true" and k == "block" else f"--{k}={v}"
                     for k, v in sorted(p.items()))
    return f"ray start {'--head ' if head else ''}{flags}"


def _quantity(q: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 1000, "M": 10**6,
             "G": 10**9}
    for u, m in units.items():
        if q.endswith(u):
            return int(float(q[:-len(u)]) * m)
    return int(q)


def auth_env(spec: dict, objs: Objects | None) -> dict[str, str]:
    """What authOptions (mode token, secretName) adds to every Ray container (pod.go): the mode,
    and the token from the Secret's auth_token."""
    auth = spec.get("authOptions") or {}
    if auth.get("mode") != "token":
        return {"RAY_AUTH_MODE": "disabled"}
    assert objs is not None and auth.get("secretName"), "authOptions token needs its Secret"
    return {"RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": objs.secret(auth["secretName"])["auth_token"].decode()}


def rayjob_pods(job: dict, cluster: str, objs: Objects | None = None) -> tuple[list[Pod], str]:
    """Head and worker pods KubeRay makes for a RayJob's rayClusterSpec; the head Service name."""
    spec = job["spec"]["rayClusterSpec"]
    head_svc = f"{cluster}-head-svc"
    common = {"RAY_CLUSTER_NAME": cluster, "RAY_PORT": str(GCS_PORT),
              "RAY_USAGE_STATS_KUBERAY_IN_USE": "1", "RAY_DASHBOARD_ENABLE_K8S_DISK_USAGE": "1",
              "RAY_CLUSTER_NAMESPACE": job["metadata"].get("namespace", NAMESPACE),
              **auth_env(spec, objs)}
    pods = []
    h = spec["headGroupSpec"]
    c = h["template"]["spec"]["containers"][0]
    cmd = _ray_start(h.get("rayStartParams") or {}, True, c)
    labels = {**(h["template"]["metadata"].get("labels") or {}), "ray.io/cluster": cluster,
              "ray.io/node-type": "head", "ray.io/is-ray-node": "yes"}
    pods.append(Pod(f"{cluster}-head", labels, h["template"]["spec"], c, "ray-head",
                    ports=_ports(c), extra_env={**common, "KUBERAY_GEN_RAY_START_CMD": cmd,
                                                "RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"}))
    fq = f"{head_svc}.{common['RAY_CLUSTER_NAMESPACE']}.svc.cluster.local"
    for g in spec.get("workerGroupSpecs") or []:
        c = g["template"]["spec"]["containers"][0]
        params = {"address": f"{fq}:{GCS_PORT}", **(g.get("rayStartParams") or {})}
        cmd = _ray_start(params, False, c)
        labels = {**(g["template"]["metadata"].get("labels") or {}), "ray.io/cluster": cluster,
                  "ray.io/node-type": "worker", "ray.io/group": g["groupName"],
                  "ray.io/is-ray-node": "yes"}
        for i in range(int(g.get("replicas", 1))):
            pods.append(Pod(f"{cluster}-{g['groupName']}-worker-{i}", labels,
                            g["template"]["spec"], c, "ray-worker", ports=_ports(c),
                            extra_env={**common, "KUBERAY_GEN_RAY_START_CMD": cmd,
                                       "FQ_RAY_IP": fq, "RAY_IP": head_svc,
                                       "RAY_ADDRESS": f"{fq}:{GCS_PORT}"}))
    return pods, head_svc


def ray_container_argv(pod: Pod) -> list[str]:
    """pod.go: the container runs `ulimit -n 65536; <ray start>` (after any user command)."""
    user = " ".join(pod.container.get("command") or []) + " ".join(pod.container.get("args") or [])
    gen = f"ulimit -n ${{RAY_START_ULIMIT_OPEN_FILES:-65536}}; {pod.extra_env['KUBERAY_GEN_RAY_START_CMD']}"
    return ["/bin/bash", "-c", f"{user} && {gen}" if user.strip() else gen]


def submitter_pod(job: dict, cluster: str) -> Pod:
    """The K8sJobMode submitter pod: the RayJob's submitterPodTemplate (KubeRay adds its own
    labels to the template's)."""
    t = job["spec"].get("submitterPodTemplate") or {"metadata": {}, "spec": {}}
    labels = {**(t["metadata"].get("labels") or {}), "ray.io/originated-from-crd": "RayJob",
              "ray.io/originated-from-cr-name": job["metadata"]["name"]}
    containers = t["spec"].get("containers") or [{}]
    return Pod(f"{cluster}-submitter", labels, t["spec"], containers[0], "submitter")


def submitter_argv(job: dict, head_svc: str, submission_id: str) -> list[str]:
    """job.go BuildJobSubmitCommand, K8sJobMode: wait for the dashboard, submit once (--no-wait,
    the submission id), then follow the logs."""
    addr = f"http://{head_svc}:{DASHBOARD_PORT}"
    entry = job["spec"]["entrypoint"].strip()
    runtime = job["spec"].get("runtimeEnvYAML")
    rt = f" --runtime-env-json {shlex.quote(json.dumps(yaml.safe_load(runtime)))}" if runtime else ""
    health = (f"python -c \"import urllib.request as u; "
              f"u.urlopen('{addr}/api/gcs_healthz', timeout=2)\"")
    sh = (f"until {health} >/dev/null 2>&1; do echo waiting for the dashboard; sleep 2; done; "
          f"if ! ray job status --address {addr} {submission_id} >/dev/null 2>&1; then "
          f"ray job submit --address {addr} --no-wait{rt} --submission-id {submission_id} "
          f"-- {entry}; fi; ray job logs --address {addr} --follow {submission_id}")
    return ["/bin/bash", "-c", sh]


def resolve_env(pod: Pod, objs: Objects) -> dict[str, str]:
    """The container env with valueFrom resolved (Secrets, ConfigMaps, downward API)."""
    env: dict[str, str] = {}
    for e in pod.container.get("env") or []:
        if "value" in e:
            env[e["name"]] = _expand(str(e["value"]), env)
            continue
        src = e["valueFrom"]
        if "secretKeyRef" in src:
            r = src["secretKeyRef"]
            env[e["name"]] = objs.secret(r["name"])[r["key"]].decode()
        elif "configMapKeyRef" in src:
            r = src["configMapKeyRef"]
            env[e["name"]] = objs.config_map(r["name"])[r["key"]].decode()
        elif "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": pod.name, "status.podIP": pod.ip,
                              "metadata.namespace": NAMESPACE}.get(path, "")
    return {**env, **pod.extra_env}


def _expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), s)


def container_argv(c: dict, env: dict[str, str]) -> list[str]:
    return [_expand(str(a), env) for a in (c.get("command") or []) + (c.get("args") or [])]


def volume_files(pod: Pod, objs: Objects) -> dict[str, dict[str, bytes] | None]:
    """Volume name -> files (Secret/ConfigMap, with `items` applied) or None (a directory)."""
    out: dict[str, dict[str, bytes] | None] = {}
    for v in pod.spec.get("volumes") or []:
        src = v.get("secret") or v.get("configMap")
        if src is None:
            out[v["name"]] = None
            continue
        data = (objs.secret(src["secretName"]) if "secret" in v
                else objs.config_map(src["name"]))
        items = src.get("items")
        out[v["name"]] = ({i["path"]: data[i["key"]] for i in items} if items else data)
    return out


# ---------------------------------------------------------------------- network policies
def _selects(sel: dict | None, labels: dict) -> bool:
    if sel is None:
        return False
    for k, v in (sel.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for ex in sel.get("matchExpressions") or []:
        val, vals = labels.get(ex["key"]), ex.get("values") or []
        op = ex["operator"]
        if (op == "In" and val not in vals) or (op == "NotIn" and val in vals) or \
                (op == "Exists" and ex["key"] not in labels) or \
                (op == "DoesNotExist" and ex["key"] in labels):
            return False
    return True


NAMESPACE_LABELS = {"kubernetes.io/metadata.name": NAMESPACE}  # every emulated pod's namespace


def _peer_ips(peer: dict, pods: list[Pod]) -> list[str] | None:
    """Source IPs a `from` entry admits (None = any address: an ipBlock we do not narrow)."""
    if "ipBlock" in peer:
        return None
    ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
    if ns_sel is not None and not _selects(ns_sel, NAMESPACE_LABELS) and ns_sel != {}:
        return []  # another namespace (monitoring, the operator's): no emulated pod there
    return [p.ip for p in pods if pod_sel is None or pod_sel == {} or _selects(pod_sel, p.labels)]


def ingress_rules(pod: Pod, pods: list[Pod], policies: list[dict]) -> list[str] | None:
    """nft rules of `pod`'s input chain, or None when no policy isolates its ingress."""
    mine = [p for p in policies if "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
            and (p["spec"].get("podSelector") == {} or _selects(p["spec"]["podSelector"],
                                                                pod.labels))]
    if not mine:
        return None
    rules = ["ct state established,related accept", "iifname lo accept"]
    for pol in mine:
        for rule in pol["spec"].get("ingress") or []:
            srcs: list[str] | None = []
            for peer in rule.get("from") or [{}]:
                ips = None if peer == {} else _peer_ips(peer, pods)
                if ips is None:
                    srcs = None
                    break
                srcs += ips  # type: ignore[operator]
            if srcs == []:
                continue
            ports = [str(pod.ports.get(p["port"], p["port"])) for p in rule.get("ports") or []]
            match = "" if srcs is None else f"ip saddr {{ {', '.join(sorted(set(srcs)))} }} "
            dport = f"tcp dport {{ {', '.join(ports)} }} " if ports else "meta l4proto tcp "
            rules.append(f"{match}{dport}accept")
    rules.append("counter drop")
    return rules
