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
- after the first step, every process of rank 1's Ray worker pod is SIGKILLed mid-step: the job
  fails (`ray job status` FAILED) and its log names the dead rank and its node
  (RankDiedError: trainer rank 1 (node <pod ip>) died ...);
- the pod is started again (as KubeRay would recreate it) and the RayJob submitted again (a new
  submission id, the same checkpoints PVC): it resumes from the last checkpoint and takes its 3
  steps; the trainer's trained-ids ledger (`read_trained_ids`) holds steps 1..N without a gap
  and every trajectory id once, and the store's accounting (over mTLS + token) balances with trained == those ids;
- no (epoch, prompt) was trained on twice, from one pod or two: each rollout pod reads its own
  shard of the dataset (the ledger's prompt sources, printed by pod);
- every push of the resumed job goes from rank 0's pod address and the configured port to both
  rollout pods; the per-tensor digests of the last push, written by each rollout pod
  (rollout `weight_digests_file`), equal rank 0's export (`weight_sync.export_digests_dir`);
- the stale share (trajectories dropped stale / produced, start, kill and resume included) is
  printed and at most 20%: the rollout pods stay within the store's backlog budget
  (`max_groups_ahead`) while the trainer starts, is down and restarts (issue 28).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))

import box as bx  # noqa: E402
import kube  # noqa: E402

from trainer.loop.ledger import read_trained_ids, read_trained_prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = REPO / ".venv" / "bin"
HELM = REPO / ".cluster-tools" / "helm"
CLUSTER = "tiny-moe-smoke-r3c01"  # KubeRay names the RayCluster <rayjob>-<random suffix>
SUBMISSION_ID = "tiny-moe-smoke-r3c01-1"
RESUBMISSION_ID = "tiny-moe-smoke-r3c01-2"  # KubeRay's retry: a new submission, same PVC
RUN_DIR = "tiny-moe-smoke"  # run.run_dir under the checkpoints PVC
EXPORT_DIGESTS = f"/checkpoints/{RUN_DIR}/export-digests"  # rank 0's pod: the PVC
ROLLOUT_DIGESTS = "weight_digests.json"  # rollout config weight_digests_file, under /tmp

PLACED = r"2 rank\(s\) on nodes \[.*?\]; MASTER_ADDR=[0-9.]+:\d+"
MAX_STALE_SHARE = 0.2  # dropped stale / produced, kill and resume included

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
    objs = kube.Objects(docs + tls_secrets(work / "pki"))
    # A test aid the manifest leaves off: rank 0 writes the digests of every push's export.
    cm = objs.get("ConfigMap", "tiny-moe-smoke")["data"]
    train = yaml.safe_load(cm["train.yaml"])
    train["weight_sync"]["export_digests_dir"] = EXPORT_DIGESTS
    cm["train.yaml"] = yaml.safe_dump(train)
    return objs


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
        ray_pods, self.head_svc = kube.rayjob_pods(self.job, CLUSTER, self.objs)
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

    def start_ready(self, pod: kube.Pod, pattern: str, timeout: float, restarts: int = 2
                    ) -> None:
        """Start the pod and wait for `pattern` in its log; a main container that exits first is
        started again (kubelet's restartPolicy Always; init containers ran already), at most
        `restarts` times: on a loaded 2-core machine a raylet may miss its GCS deadline."""
        before = len(re.findall(pattern, self.log(pod)))
        deadline = time.monotonic() + timeout
        proc = self.start(pod)
        while len(re.findall(pattern, self.log(pod))) <= before:
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

    def start(self, pod: kube.Pod, init: bool = True) -> subprocess.Popen:
        """Init containers to completion, then the main container (KubeRay's for Ray pods)."""
        ns = self.ns(pod)
        for c in pod.init_containers if init else []:
            p = self.box.start(ns, kube.container_argv(c, self.env(pod, c)), self.env(pod, c),
                               self.mounts(pod, c), f"init-{c['name']}")
            assert p.wait(timeout=180) == 0, f"{pod.name} init {c['name']} failed"
        env = self.env(pod)
        argv = (kube.ray_container_argv(pod) if pod.kind.startswith("ray-")
                else kube.container_argv(pod.container, env))
        return self.box.start(ns, argv, env, self.mounts(pod, pod.container), "main")

    def submit(self, submission_id: str = SUBMISSION_ID, log: str = "submitter"
               ) -> subprocess.Popen:
        pod = self.by_name(f"{CLUSTER}-submitter")[0]
        env = {**self.ray_auth(pod), "PATH": f"{VENV_BIN}:/usr/bin:/bin",
               "HOME": str(self.ns(pod).root), "PYTHONUNBUFFERED": "1"}
        return self.box.start(self.ns(pod), kube.submitter_argv(self.job, self.head_svc,
                                                                 submission_id),
                              env, {}, log)

    def ray_auth(self, pod: kube.Pod) -> dict[str, str]:
        """The submitter's RAY_AUTH_* env (its template reads the cluster's token Secret)."""
        return {k: v for k, v in kube.resolve_env(pod, self.objs).items()
                if k.startswith("RAY_AUTH_")}

    def job_status(self, submission_id: str, token: bool = True) -> str:
        """`ray job status` from the submitter pod (SUCCEEDED, FAILED, ...); token=False asks
        without the cluster's token (the answer is then the refusal)."""
        pod = self.by_name(f"{CLUSTER}-submitter")[0]
        addr = f"http://{self.head_svc}:{kube.DASHBOARD_PORT}"
        auth = self.ray_auth(pod) if token else {"RAY_AUTH_MODE": "disabled"}
        r = self.box.exec(self.ns(pod), [str(VENV_BIN / "ray"), "job", "status", "--address",
                                         addr, submission_id], timeout=60,
                          env={**auth, "PATH": f"{VENV_BIN}:/usr/bin:/bin",
                               "HOME": str(self.ns(pod).root)})
        m = re.search(r"\b(succeeded|failed|stopped|running|pending)\b", r.stdout + r.stderr,
                      re.I)
        return m[1].upper() if m else (r.stdout + r.stderr)[-300:]

    def submit_status(self, token: str | None) -> int:
        """HTTP status of a job submission (POST /api/jobs/) from the submitter pod, with the
        given bearer token or none."""
        pod = self.by_name(f"{CLUSTER}-submitter")[0]
        url = f"http://{self.head_svc}:{kube.DASHBOARD_PORT}/api/jobs/"
        code = ("import json, sys, urllib.request as u, urllib.error as e\n"
                f"r = u.Request({url!r}, data=json.dumps({{'entrypoint': 'true'}}).encode(),"
                " headers={'Content-Type': 'application/json'})\n"
                "if sys.argv[1]: r.add_header('Authorization', 'Bearer ' + sys.argv[1])\n"
                "try: print(u.urlopen(r, timeout=30).status)\n"
                "except e.HTTPError as x: print(x.code)\n")
        r = self.box.exec(self.ns(pod), [str(VENV_BIN / "python"), "-c", code, token or ""],
                          timeout=60, env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})
        return int(r.stdout.strip().splitlines()[-1])

    def log(self, pod: kube.Pod, name: str = "main") -> str:
        path = self.ns(pod).root / f"{name}.log"
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

    def connect(self, src: kube.Pod, ip: str, port: int, timeout: float = 3) -> bool:
        code = (f"import socket; s=socket.socket(); s.settimeout({timeout}); "
                f"s.connect(('{ip}', {port})); print('ok')")
        r = self.box.exec(self.ns(src), [str(VENV_BIN / "python"), "-c", code],
                          timeout=timeout + 10)
        return r.returncode == 0 and "ok" in r.stdout


def _finish(proc: subprocess.Popen, timeout: float, log_tail: Callable[[], str]) -> int:
    """The exit code of `proc`; past `timeout` it is killed and the test fails with its log
    (read after the kill, so the message shows where it hung)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"still running after {timeout:.0f}s:\n{log_tail()[-4000:]}") from None


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
    c.start_ready(head, r"Ray runtime started", 300)
    for w in workers:
        c.start_ready(w, r"Ray runtime started", 300)
    for r in rollouts:  # as the startup probe would: both engines serve before the job starts
        c.wait_log(r, r"engine ready", 400)
    sub = c.submit()
    spod = c.by_name(f"{CLUSTER}-submitter")[0]
    placed = c.wait_log(spod, PLACED, 400, "submitter")
    nodes = re.findall(r"'([0-9.]+)'", placed)
    master = re.search(r"MASTER_ADDR=([0-9.]+)", placed)[1]  # type: ignore[index]
    assert len(set(nodes)) == 2 and set(nodes) <= {w.ip for w in workers}, placed
    assert master == nodes[0] and master != "127.0.0.1"
    # SIGKILL the pod of rank 1 mid-step (after the first step and its checkpoint began): the
    # job fails, naming the dead rank and its node.
    _eventually(lambda: len(train_log(c)) >= 1, 400)
    assert train_log(c), c.log(spod, "submitter")[-4000:]
    victim = next(w for w in workers if w.ip == nodes[1])
    killed = c.box.kill_pod(c.ns(victim))
    assert killed, "no process in the victim pod"
    t_kill = time.monotonic()
    _finish(sub, 300, lambda: c.log(spod, "submitter"))
    failed_log = c.log(spod, "submitter")
    assert re.search(rf"RankDiedError: trainer rank 1 \(node {re.escape(victim.ip)}\) died",
                     failed_log), failed_log[-4000:]
    assert re.search(rf"Job '{SUBMISSION_ID}' failed", failed_log), failed_log[-4000:]
    status1 = c.job_status(SUBMISSION_ID)  # reported, for the record
    # Ray token auth (the RayJob's authOptions): a submission without the token is refused;
    # this test's own submissions above and below carry it (the submitter's Secret env).
    unauthenticated = c.submit_status(None)
    assert unauthenticated in (401, 403), f"dashboard accepted a job without the token: " \
                                          f"HTTP {unauthenticated}"
    failed_in = round(time.monotonic() - t_kill, 1)
    # KubeRay recreates the pod; the RayJob is submitted again (a new submission id): it
    # resumes from the last checkpoint on the PVC.
    c.start_ready(victim, r"Ray runtime started", 300)
    sub2 = c.submit(RESUBMISSION_ID, "submitter-2")
    rc2 = _finish(sub2, 600, lambda: c.log(spod, "submitter-2"))
    assert rc2 == 0, c.log(spod, "submitter-2")[-4000:]
    status2 = c.job_status(RESUBMISSION_ID)
    job_log = c.log(spod, "submitter-2")
    resumed = re.search(r"resum\w* (?:from|at) (?:step )?(\d+)", job_log, re.I)
    placed2 = re.search(PLACED, job_log)
    assert placed2, job_log[-4000:]
    nodes2 = re.findall(r"'([0-9.]+)'", placed2[0])
    master2 = re.search(r"MASTER_ADDR=([0-9.]+)", placed2[0])[1]  # type: ignore[index]
    assert len(set(nodes2)) == 2 and set(nodes2) <= {w.ip for w in workers}, placed2[0]
    # Nothing trained twice, nothing lost: the ledger's surviving steps are 1..N without a gap
    # (run.steps counts the steps of each submission: N = resume point + 3), each id once.
    ledger = read_trained_ids(c.pvcs["tiny-moe-smoke-checkpoints"] / RUN_DIR
                              / "trained_ids.jsonl")
    assert sorted(ledger) == list(range(1, len(ledger) + 1)) and len(ledger) >= 4, ledger
    ids = [i for step in ledger.values() for i in step]
    assert len(ids) == len(set(ids)) and len(ids) >= 3 * 2 * 2, ledger
    # The rollout pods read disjoint shards of the prompts (docs/rollout-data.md): every
    # (epoch, prompt) trained on came from one group of one pod, never from two. Which pods'
    # groups the trainer happened to take varies run to run (both, in most runs here).
    sources = [s for step in read_trained_prompts(c.pvcs["tiny-moe-smoke-checkpoints"]
                                                  / RUN_DIR / "trained_ids.jsonl").values()
               for s in step]
    assert {w for w, _, _ in sources} <= {r.name for r in rollouts}, sources
    prompts = [(e, p) for _, e, p in sources]
    assert len(sources) == len(ids) // 2 and len(set(prompts)) == len(prompts), sources
    shards = prompt_shards(sources)
    # Each push of the resumed job went from rank 0's pod (its address, the configured port) to
    # both rollout pods; the last one's digests on both pods equal the trainer's export.
    pushes = re.findall(r"pushed v(\d+) from ([0-9.]+):(\d+) to (\d+) worker", job_log)
    assert pushes and all(ip == master2 and port == "29600" for _, ip, port, _ in pushes), pushes
    last = int(pushes[-1][0])
    assert last >= 3 and pushes[-1][3] == "2", (pushes, _tails(c, rollouts))
    for r in rollouts:
        c.wait_log(r, rf"policy version {last}\b", 60)
    want = json.loads((c.pvcs["tiny-moe-smoke-checkpoints"] / RUN_DIR / "export-digests"
                       / f"v{last}.json").read_text())
    assert want["version"] == last and want["digests"]
    for r in rollouts:
        got = json.loads((c.ns(r).root / "vol" / "tmp" / ROLLOUT_DIGESTS).read_text())
        assert got["version"] == last, (r.name, got["version"])
        assert set(got["digests"]) == set(want["digests"]), r.name
        bad = sorted(n for n in want["digests"] if got["digests"][n] != want["digests"][n])
        assert not bad, (r.name, bad[:5])
    acc = accounting(c)
    assert acc["balanced"] and acc["trained"] == len(ids), (acc, len(ids))
    # Rollouts stay within the store's backlog budget (max_groups_ahead) while the trainer
    # starts, trains, is killed and resumes: little of what they produce goes stale (issue 28).
    stale_share = acc["dropped"].get("stale", 0) / max(1, acc["produced"])
    print(json.dumps({"seconds": round(time.monotonic() - t0, 1), "nodes": nodes,
                      "master": master, "killed": victim.name, "failed_in_s": failed_in,
                      "status": [status1, status2],
                      "resumed": resumed[0] if resumed else None, "nodes2": nodes2,
                      "pushes": pushes, "digests": len(want["digests"]),
                      "ledger_steps": sorted(ledger), "accounting": acc,
                      "prompts_by_pod": {k: sorted(v) for k, v in shards.items()},
                      "stale_share": round(stale_share, 3)}))
    print(f"stale share: {acc['dropped'].get('stale', 0)} dropped stale / {acc['produced']} "
          f"produced = {stale_share:.1%}")
    assert stale_share <= MAX_STALE_SHARE, acc


def _tails(c: Cluster, pods: list, chars: int = 2500) -> dict[str, str]:
    """The last lines of each pod's log, for a failure message."""
    return {p.name: c.log(p)[-chars:] for p in pods}


def prompt_shards(sources: list[tuple[str, int, str]]) -> dict[str, set[tuple[int, str]]]:
    """Rollout pod (worker id) -> the (epoch, prompt id) of every group trained on from it."""
    out: dict[str, set[tuple[int, str]]] = {}
    for worker, epoch, prompt in sources:
        out.setdefault(worker, set()).add((epoch, prompt))
    return out


def train_log(c: Cluster) -> list[dict]:
    path = c.pvcs["tiny-moe-smoke-checkpoints"] / RUN_DIR / "train_log.jsonl"
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
