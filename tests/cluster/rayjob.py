"""A RayJob in the box, as the KubeRay operator runs it (ray-operator v1.7, job.go and the RayJob
retry with `backoffLimit`): each attempt gets a RayCluster of its own, named
`<rayjob>-<suffix>` (head, worker pods, head Service), and a submitter pod that submits the
entrypoint with a new submission id. A failed attempt's RayCluster is deleted as a whole (every
pod, head included) and the next attempt's is created from scratch: new pods at new addresses, a
new head (a new GCS), the job submitted again; only the PVCs carry over.
"""

from __future__ import annotations

import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import kube
import yaml
from cluster import VENV_BIN, Cluster, ContainerDied

READY = r"Ray runtime started"
TERMINATION_GRACE_S = 5.0  # the box's stand-in for the pods' terminationGracePeriodSeconds


def apply(c: Cluster, docs: list[dict], digests: bool = True) -> RayJobRun:
    """`kubectl apply` of a RayJob spec (its ConfigMap and RayJob) into the cluster: a test aid
    the manifests leave off is added: rank 0 writes the digests of every push's export under the
    run directory (`weight_sync.export_digests_dir`), which the test compares with the engines'."""
    job = next(d for d in docs if d["kind"] == "RayJob")
    c.objs.docs += docs
    run = RayJobRun(c, job)
    if digests:
        run.edit_config(lambda t: t.setdefault("weight_sync", {}).update(
            export_digests_dir=f"{t['run']['run_dir']}/export-digests"))
    return run


class RayJobRun:
    """One RayJob: its attempts (`attempt`), each a RayCluster and a submitter pod."""

    def __init__(self, c: Cluster, job: dict) -> None:
        self.c, self.job = c, job
        self.name = job["metadata"]["name"]
        self.attempts = 0
        self.pods: list[kube.Pod] = []  # the current attempt's RayCluster + submitter
        self.cluster_name = self.submission_id = ""
        self.submitter_runs = 0  # of the current attempt's submitter pod

    # ------------------------------------------------------------------ the spec
    @property
    def head_template(self) -> dict:
        return self.job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]

    def config_map(self) -> dict:
        vols = self.head_template["spec"]["volumes"]
        name = next(v["configMap"]["name"] for v in vols if "configMap" in v)
        return self.c.objs.get("ConfigMap", name)

    def train_config(self) -> dict:
        return yaml.safe_load(self.config_map()["data"]["train.yaml"])

    def edit_config(self, edit) -> None:
        """Change the ConfigMap's train.yaml in place: `edit(dict)`."""
        cfg = self.train_config()
        edit(cfg)
        self.config_map()["data"]["train.yaml"] = yaml.safe_dump(cfg, sort_keys=False)

    def run_dir(self) -> Path:
        """run.run_dir on the host: its path under the PVC the head mounts there."""
        run_dir = self.train_config()["run"]["run_dir"]
        mounts = {m["name"]: m["mountPath"] for m in self.head_template["spec"]["containers"][0]
                  ["volumeMounts"]}
        for v in self.head_template["spec"]["volumes"]:
            mp = mounts.get(v["name"], "")
            if "persistentVolumeClaim" in v and run_dir.startswith(mp.rstrip("/") + "/"):
                return self.c.pvc(v["persistentVolumeClaim"]["claimName"]) / run_dir[len(mp):]\
                    .lstrip("/")
        raise AssertionError(f"run.run_dir {run_dir} is on no PVC: a retry would not resume")

    # ------------------------------------------------------------------ attempts
    def attempt(self) -> list[kube.Pod]:
        """A new RayCluster and submitter pod (new names, new addresses), Ray started on it with
        KubeRay's commands: init containers of every pod at once, the head, then the workers."""
        assert not self.pods, "the previous attempt's RayCluster still exists"
        self.attempts += 1
        self.c.job_starts += 1
        self.cluster_name = f"{self.name}-r3c{self.attempts:02d}"
        self.submission_id = f"{self.cluster_name}-job"
        self.submitter_runs = 0
        ray_pods, _ = kube.rayjob_pods(self.job, self.cluster_name, self.c.objs)
        self.pods = ray_pods + [kube.submitter_pod(self.job, self.cluster_name)]
        self.c.add_pods(self.pods)
        with ThreadPoolExecutor(len(ray_pods)) as ex:
            list(ex.map(self.c.run_init, ray_pods))
        for tries in range(2):
            try:
                return self.start_ray()
            except (ContainerDied, TimeoutError) as e:
                if tries:
                    raise
                # kubelet restarts the head's container (its GCS is new) and the workers'
                print(f"{self.cluster_name}: {e}: every Ray container restarted", flush=True)
                for p in ray_pods:
                    self.c.box.stop_pod(self.c.ns(p))
        raise AssertionError("unreachable")

    def start_ray(self) -> list[kube.Pod]:
        """KubeRay's `ray start` on the head, then on every worker at once; the head must still
        run when they joined (a head that dies on a loaded machine after starting, e.g. its
        Ray client server timing out, takes the cluster with it)."""
        head = self.c.start_ready(self.head, READY, 300, init=False)
        died = lambda: head.poll() is not None  # noqa: E731
        with ThreadPoolExecutor(len(self.workers)) as ex:
            list(ex.map(lambda w: self.c.start_ready(w, READY, 300, init=False, abort=died),
                        self.workers))
        if died():
            raise ContainerDied(f"{self.head.name}: exited ({head.returncode}) after starting")
        return self.pods

    def delete(self) -> None:
        """KubeRay deletes the attempt's RayCluster and submitter: every pod stopped."""
        self.c.remove_pods(self.pods, TERMINATION_GRACE_S)
        self.pods = []

    @property
    def head(self) -> kube.Pod:
        return next(p for p in self.pods if p.kind == "ray-head")

    @property
    def workers(self) -> list[kube.Pod]:
        return [p for p in self.pods if p.kind == "ray-worker"]

    @property
    def submitter(self) -> kube.Pod:
        return next(p for p in self.pods if p.kind == "submitter")

    @property
    def head_svc(self) -> str:
        return f"{self.cluster_name}-head-svc"

    # ------------------------------------------------------------------ the job
    def submit(self) -> subprocess.Popen:
        """The submitter pod's command (job.go, K8sJobMode); each run logs to a file of its own
        (`ray job logs --follow` prints the job's log from its start)."""
        pod = self.submitter
        env = {**self.ray_auth(), "PATH": f"{VENV_BIN}:/usr/bin:/bin",
               "HOME": str(self.c.ns(pod).root), "PYTHONUNBUFFERED": "1"}
        argv = kube.submitter_argv(self.job, self.head_svc, self.submission_id)
        self.submitter_runs += 1
        return self.c.box.start(self.c.ns(pod), argv, env, {}, self.log_name)

    @property
    def log_name(self) -> str:
        return f"submitter-{self.submitter_runs}"

    def log(self) -> str:
        """The job's log as the latest submitter run followed it."""
        return self.c.log(self.submitter, self.log_name)

    def follow(self, sub: subprocess.Popen, timeout: float, retries: int = 2) -> str:
        """Wait for the submitter; KubeRay reads the outcome from the dashboard (`ray job
        status`), not from the submitter's exit. A submitter that exits while the job still
        runs (its `ray job logs --follow` cut off on a loaded machine) is run again, as the
        submitter Job's backoffLimit would: it finds the submission and follows it again.
        Returns the job's final status."""
        deadline = time.monotonic() + timeout
        while True:
            rc = finish(sub, max(1.0, deadline - time.monotonic()), self.log)
            status = self.job_status()
            if status not in ("RUNNING", "PENDING") or retries == 0:
                return status
            retries -= 1
            print(f"{self.submitter.name}: exited {rc} with the job {status}: run again",
                  flush=True)
            sub = self.submit()

    def ray_auth(self) -> dict[str, str]:
        """The submitter's RAY_AUTH_* env (its template reads the cluster's token Secret)."""
        return {k: v for k, v in kube.resolve_env(self.submitter, self.c.objs).items()
                if k.startswith("RAY_AUTH_")}

    def job_status(self) -> str:
        """`ray job status` of this attempt's submission, from the submitter pod."""
        pod = self.submitter
        addr = f"http://{self.head_svc}:{kube.DASHBOARD_PORT}"
        r = self.c.box.exec(self.c.ns(pod), [str(VENV_BIN / "ray"), "job", "status", "--address",
                                             addr, self.submission_id], timeout=60,
                            env={**self.ray_auth(), "PATH": f"{VENV_BIN}:/usr/bin:/bin",
                                 "HOME": str(self.c.ns(pod).root)})
        m = re.search(r"\b(succeeded|failed|stopped|running|pending)\b", r.stdout + r.stderr,
                      re.I)
        return m[1].upper() if m else (r.stdout + r.stderr)[-300:]

    def submit_status(self, token: str | None) -> int:
        """HTTP status of a job submission (POST /api/jobs/) from the submitter pod, with the
        given bearer token or none."""
        url = f"http://{self.head_svc}:{kube.DASHBOARD_PORT}/api/jobs/"
        code = ("import json, sys, urllib.request as u, urllib.error as e\n"
                f"r = u.Request({url!r}, data=json.dumps({{'entrypoint': 'true'}}).encode(),"
                " headers={'Content-Type': 'application/json'})\n"
                "if sys.argv[1]: r.add_header('Authorization', 'Bearer ' + sys.argv[1])\n"
                "try: print(u.urlopen(r, timeout=30).status)\n"
                "except e.HTTPError as x: print(x.code)\n")
        r = self.c.python(self.submitter, code, token or "",
                          env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})
        return int(r.stdout.strip().splitlines()[-1])


def finish(proc: subprocess.Popen, timeout: float, log_tail) -> int:
    """The exit code of `proc`; past `timeout` it is killed and the test fails with its log
    (read after the kill, so the message shows where it hung)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"still running after {timeout:.0f}s:\n{log_tail()[-4000:]}") from None
