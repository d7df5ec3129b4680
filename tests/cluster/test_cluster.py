"""Cluster in a box (issue 17 item 4): the rendered chart and the RayJob of
k8s/tiny-moe-smoke.yaml run as real processes, each pod in its own network namespace with its own
address (tests/cluster/box.py), Services through per-pod hosts files, NetworkPolicies as nftables
rules, KubeRay's part played by the commands its operator would run (tests/cluster/kube.py).

What it checks, in order (docs/cluster-test.md: status, and what only a real cluster shows):
- the chart renders with mTLS, role tokens, Redis auth and NetworkPolicies on, and its Redis and
  store pods serve at their pod addresses (the store reaches Redis by Service name, with auth);
- NetworkPolicies are enforced: a rollout pod cannot reach Redis, the store can;
- a Ray head and two Ray worker pods started with KubeRay's `ray start` commands form one cluster
  (workers dial the head Service's FQDN); the submitter's `ray job submit` runs the RayJob's
  entrypoint on the head; the trainer joins that cluster and places its 2 ranks (EP=2, gloo) one
  on each worker pod, rendezvous at rank 0's pod address;
- the job runs >= 3 GRPO steps on groups from the 2 vLLM-CPU rollout pods, each push goes from
  rank 0's pod address to both rollout pods, which end at policy version 3; every trajectory is
  accounted for (services.local.accounting against the secured store).
Not built yet: per-tensor digest comparison of the pushed weights, and the SIGKILL of a Ray
worker pod mid-step with resubmission/resume (see the docs' status).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import box as bx  # noqa: E402
import kube  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HELM = REPO / ".cluster-tools" / "helm"
CLUSTER = "tiny-moe-smoke-r3c01"  # KubeRay names the RayCluster <rayjob>-<random suffix>
SUBMISSION_ID = "tiny-moe-smoke-r3c01-1"

pytestmark = pytest.mark.timeout(900)


def _netns_or_skip() -> None:
    why = bx.can_create_netns()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cluster test needs network namespaces: {why}")
        pytest.skip(f"cluster test needs network namespaces: {why}")


def render(work: Path) -> kube.Objects:
    """helm template (tests/cluster/values.yaml) + k8s/tiny-moe-smoke.yaml + the TLS Secrets."""
    out = subprocess.run([str(HELM), "template", "r3flow", str(REPO / "helm" / "r3flow"),
                          "--namespace", "r3flow", "--api-versions", "ray.io/v1",
                          "-f", str(REPO / "tests" / "cluster" / "values.yaml")],
                         check=True, capture_output=True, text=True).stdout
    docs = kube.load_docs(out) + kube.load_docs((REPO / "k8s" / "tiny-moe-smoke.yaml").read_text())
    return kube.Objects(docs + tls_secrets(work / "pki"))


def tls_secrets(d: Path) -> list[dict]:
    """A CA, the store's serving cert (its Service names) and a client cert, as cert-manager
    would put them into Secrets."""
    d.mkdir(parents=True, exist_ok=True)

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=r3c-ca",
        "-keyout", "ca.key", "-out", "ca.crt")
    sans = "DNS:r3flow-store,DNS:r3flow-store.r3flow,DNS:r3flow-store.r3flow.svc"
    for name, ext in (("store", f"subjectAltName={sans}"), ("client", "subjectAltName=DNS:client")):
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout",
            f"{name}.key", "-out", f"{name}.csr")
        (d / f"{name}.ext").write_text(ext + "\n")
        ssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext")

    def secret(name: str, who: str) -> dict:
        import base64

        files = {"tls.crt": f"{who}.crt", "tls.key": f"{who}.key", "ca.crt": "ca.crt"}
        return {"kind": "Secret", "metadata": {"name": name}, "data": {
            k: base64.b64encode((d / f).read_bytes()).decode() for k, f in files.items()}}

    return [secret("r3flow-store-tls", "store"), secret("r3flow-client-tls", "client")]


def models_volume(path: Path) -> Path:
    """The models PVC: the tiny MoE every pod builds from the same seed, and the prompts."""
    subprocess.run([str(VENV_BIN / "r3flow"), "model", "tiny-moe", "--out",
                    str(path / "tiny-moe")], check=True, capture_output=True)
    from services.local.tasks import TaskConfig, write_datasets

    write_datasets(TaskConfig(max_operand=9), path / "datasets")
    return path


class Cluster:
    """The rendered objects run in a Box."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.box = bx.Box(work)
        self.objs = render(work)
        self.job = self.objs.get("RayJob", "tiny-moe-smoke")
        ray_pods, self.head_svc = kube.rayjob_pods(self.job, CLUSTER)
        submitter = kube.submitter_pod(self.job, CLUSTER)
        self.pods = kube.workload_pods(self.objs) + ray_pods + [submitter]
        self.pvcs = {"r3flow-models": models_volume(work / "pvc" / "r3flow-models"),
                     "tiny-moe-smoke-checkpoints": work / "pvc" / "checkpoints"}
        self.pvcs["tiny-moe-smoke-checkpoints"].mkdir(parents=True, exist_ok=True)

    def by_name(self, prefix: str) -> list[kube.Pod]:
        return [p for p in self.pods if p.name.startswith(prefix)]

    def ns(self, pod: kube.Pod) -> bx.NsPod:
        return self.box.pods[pod.name]

    def up(self) -> None:
        self.box.up()
        for p in self.pods:
            p.ip = self.box.add_pod(p.name).ip
        self.box.write_hosts(self.service_names())
        policies = self.objs.of("NetworkPolicy")
        for p in self.pods:
            self.box.enforce(self.ns(p), kube.ingress_rules(p, self.pods, policies))

    def service_names(self) -> dict[str, list[str]]:
        names: dict[str, list[str]] = {}
        for svc in self.objs.of("Service"):
            sel = svc["spec"].get("selector") or {}
            ips = [p.ip for p in self.pods if sel and all(p.labels.get(k) == v
                                                          for k, v in sel.items())]
            for n in _dns(svc["metadata"]["name"]):
                names[n] = ips
            if svc["spec"].get("clusterIP") == "None":  # headless: <pod>.<svc>
                for p in self.pods:
                    if p.ip in ips:
                        for n in _dns(f"{p.name}.{svc['metadata']['name']}"):
                            names[n] = [p.ip]
        head = [p.ip for p in self.pods if p.kind == "ray-head"]
        for n in _dns(self.head_svc):
            names[n] = head
        return names

    # ------------------------------------------------------------------ processes
    def env(self, pod: kube.Pod, container: dict | None = None) -> dict[str, str]:
        c = container or pod.container
        import resource

        # the node's open-files hard limit (KubeRay raises the soft limit to 65536 where it may)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        base = {"PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1",
                "RAY_START_ULIMIT_OPEN_FILES": str(min(65536, nofile))}
        resolved = kube.resolve_env(kube.Pod(pod.name, pod.labels, pod.spec, c, pod.kind,
                                             pod.ip, pod.ports, pod.extra_env), self.objs)
        return {**base, **resolved}

    def mounts(self, pod: kube.Pod, container: dict) -> dict[str, Path]:
        """mountPath -> host directory for each of the container's volumeMounts."""
        files = kube.volume_files(pod, self.objs)
        vols = {v["name"]: v for v in pod.spec.get("volumes") or []}
        out: dict[str, Path] = {}
        for m in container.get("volumeMounts") or []:
            v = vols.get(m["name"], {})  # absent: a StatefulSet's volumeClaimTemplate (per pod)
            if "persistentVolumeClaim" in v:
                src = self.pvcs[v["persistentVolumeClaim"]["claimName"]]
            else:
                src = self.ns(pod).root / "vol" / m["name"]
                src.mkdir(parents=True, exist_ok=True)
                for rel, data in (files.get(m["name"]) or {}).items():
                    (src / rel).parent.mkdir(parents=True, exist_ok=True)
                    (src / rel).write_bytes(data)
            out[m["mountPath"]] = src
        return out

    def start(self, pod: kube.Pod) -> subprocess.Popen:
        """Init containers to completion, then the main container (KubeRay's for Ray pods)."""
        ns = self.ns(pod)
        for c in pod.init_containers:
            p = self.box.start(ns, kube.container_argv(c, self.env(pod, c)), self.env(pod, c),
                               self.mounts(pod, c), f"init-{c['name']}")
            assert p.wait(timeout=180) == 0, f"{pod.name} init {c['name']} failed"
        env = self.env(pod)
        argv = (kube.ray_container_argv(pod) if pod.kind.startswith("ray-")
                else kube.container_argv(pod.container, env))
        return self.box.start(ns, argv, env, self.mounts(pod, pod.container), "main")

    def submit(self) -> subprocess.Popen:
        pod = self.by_name(f"{CLUSTER}-submitter")[0]
        env = {"PATH": f"{VENV_BIN}:/usr/bin:/bin", "RAY_AUTH_MODE": "disabled",
               "HOME": str(self.ns(pod).root), "PYTHONUNBUFFERED": "1"}
        return self.box.start(self.ns(pod), kube.submitter_argv(self.job, self.head_svc,
                                                                 SUBMISSION_ID),
                              env, {}, "submitter")

    def log(self, pod: kube.Pod, name: str = "main") -> str:
        path = self.ns(pod).root / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, pod: kube.Pod, pattern: str, timeout: float, name: str = "main") -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.log(pod, name))
            if m:
                return m[0]
            time.sleep(1)
        raise TimeoutError(f"{pod.name}: no {pattern!r} in {timeout:.0f}s:\n"
                           + self.log(pod, name)[-3000:])

    def connect(self, src: kube.Pod, ip: str, port: int, timeout: float = 3) -> bool:
        code = (f"import socket; s=socket.socket(); s.settimeout({timeout}); "
                f"s.connect(('{ip}', {port})); print('ok')")
        r = self.box.exec(self.ns(src), [str(VENV_BIN / "python"), "-c", code],
                          timeout=timeout + 10)
        return r.returncode == 0 and "ok" in r.stdout


def _dns(name: str) -> list[str]:
    return [name, f"{name}.r3flow", f"{name}.r3flow.svc", f"{name}.r3flow.svc.cluster.local"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    _netns_or_skip()
    if not HELM.exists():
        pytest.fail("helm is missing: run `make test-cluster` (tests/cluster/setup.sh fetches it)")
    bx.clean_leftovers()
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.up()
        yield c
    finally:
        c.box.close()
        assert not bx.leftovers(), f"left behind: {bx.leftovers()}"


def test_cluster_in_a_box(cluster: Cluster):
    c = cluster
    t0 = time.monotonic()
    redis, store = c.by_name("r3flow-redis")[0], c.by_name("r3flow-store")[0]
    rollouts = c.by_name("r3flow-rollout")
    c.start(redis)
    c.wait_log(redis, r"Ready to accept connections", 60)
    c.start(store)
    # NetworkPolicies: the store may reach Redis, a rollout pod may not (dropped: a timeout)
    assert c.connect(store, redis.ip, 6379), "store -> redis must be allowed"
    assert not c.connect(rollouts[0], redis.ip, 6379), "rollout -> redis must be denied"
    assert _eventually(lambda: c.connect(rollouts[0], store.ip, 50051), 90), "rollout -> store"
    for r in rollouts:  # vLLM-CPU starts slowly: while the Ray cluster comes up
        c.start(r)
    head = c.by_name(f"{CLUSTER}-head")[0]
    workers = [p for p in c.pods if p.kind == "ray-worker"]
    assert len(workers) >= 2
    c.start(head)
    c.wait_log(head, r"Ray runtime started", 240)
    for w in workers:
        c.start(w)
    for w in workers:
        c.wait_log(w, r"Ray runtime started", 240)
    for r in rollouts:  # as the startup probe would: both engines serve before the job starts
        c.wait_log(r, r"engine ready", 400)
    sub = c.submit()
    spod = c.by_name(f"{CLUSTER}-submitter")[0]
    placed = c.wait_log(spod, r"2 rank\(s\) on nodes \[.*?\]; MASTER_ADDR=[0-9.]+:\d+", 400,
                        "submitter")
    nodes = re.findall(r"'([0-9.]+)'", placed)
    master = re.search(r"MASTER_ADDR=([0-9.]+)", placed)[1]  # type: ignore[index]
    assert len(set(nodes)) == 2 and set(nodes) <= {w.ip for w in workers}, placed
    assert master == nodes[0] and master != "127.0.0.1"
    # The job runs to its end (the submitter follows its logs and exits with it).
    assert sub.wait(timeout=600) == 0, c.log(spod, "submitter")[-4000:]
    job_log = c.log(spod, "submitter")
    steps = train_log(c)
    assert len(steps) >= 3, steps
    # Each push went from rank 0's pod (its address, the configured port) to both rollout pods.
    pushes = re.findall(r"pushed v(\d+) from ([0-9.]+):(\d+) to (\d+) worker", job_log)
    assert pushes and all(ip == master and port == "29600" for _, ip, port, _ in pushes), pushes
    assert pushes[-1][0] == "3" and pushes[-1][3] == "2", pushes
    for r in rollouts:
        c.wait_log(r, r"policy version 3", 60)
    acc = accounting(c)
    assert acc["balanced"] and acc["trained"] >= 3 * 2 * 2, acc
    print(json.dumps({"seconds": round(time.monotonic() - t0, 1), "nodes": nodes,
                      "master": master, "pushes": pushes, "accounting": acc}))


def train_log(c: Cluster) -> list[dict]:
    path = c.pvcs["tiny-moe-smoke-checkpoints"] / "tiny-moe-smoke" / "train_log.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def accounting(c: Cluster) -> dict:
    """services.local.accounting over the secured store, from the head pod (a trainer pod: the
    store admits it), after the rollout pods stopped (SIGTERM, as kubelet stops a pod)."""
    import signal

    for r in c.by_name("r3flow-rollout"):
        for p in c.ns(r).procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in c.ns(r).procs:
            p.wait(timeout=120)
    head = c.by_name(f"{CLUSTER}-head")[0]
    vol = c.ns(head).root / "vol"
    code = f"""
import json
from services.common.auth import ClientAuth, ClientAuthConfig
from services.local.accounting import Accounting
auth = ClientAuth.from_config(ClientAuthConfig(
    token_file="{vol}/tokens/token", ca_file="{vol}/tls/ca.crt",
    cert_file="{vol}/client-tls/tls.crt", key_file="{vol}/client-tls/tls.key"))
acc = Accounting.collect("r3flow-store:50051", [], group_size=2, max_in_flight=16, auth=auth)
print(json.dumps(acc.as_dict()))
"""
    r = c.box.exec(c.ns(head), [str(VENV_BIN / "python"), "-c", code], timeout=120,
                   env={**c.env(head), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _eventually(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(1)
    return False


if __name__ == "__main__":  # pragma: no cover
    print(yaml.safe_dump({"pods": [p.name for p in Cluster(Path(sys.argv[1])).pods]}))
