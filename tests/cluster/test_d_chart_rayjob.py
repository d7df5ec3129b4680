"""The chart's own trainer RayJob (issue 32 (a)): `helm template` with tests/cluster/values.yaml
and chart-trainer-values.yaml (trainer.enabled, 2 CPU worker pods, the tiny MoE's layout, 3
steps) on the same release; its RayJob and trainer ConfigMap applied (the release's other objects,
its Secrets included, are the ones running). The job runs to completion: one rank per worker
pod, rendezvous at rank 0's pod address, the ledger gapless with each id once, rank 0's pushes
reach both rollout pods and the digests of the last one equal its export; a job submission
without the Ray token is refused (the chart's authOptions). Once the job has ended, both rollout
pods are idle within IDLE_BOUND_S, measured (stopping a job stops the spend,
docs/operations.md): trainer gone, no request in flight, no token generated after."""

from __future__ import annotations

import json
import re
import time

import pytest
from cluster import REPO, Cluster, helm_template
from rayjob import RayJobRun, apply
from retry import auth_refused, check_ledger, check_pushes, placement, shutdown_finished

pytestmark = pytest.mark.timeout(1800)  # a safety net: a loaded 2-core box is slow
VALUES = [REPO / "tests" / "cluster" / f for f in ("values.yaml", "chart-trainer-values.yaml")]
TRAINER = {("RayJob", "r3flow-trainer"), ("ConfigMap", "r3flow-trainer")}
# From the job's end to every rollout pod idle: the trainer left the store at its exit, so the
# watch (0.5 s) and the groups in flight (6 tokens a request here) are what remain; the rest is
# room for a loaded 2-core box.
IDLE_BOUND_S = 30.0
QUIET_S = 5.0  # no token generated for this long once idle
METRICS = """
import sys, urllib.request
print(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=5).read().decode())
"""


def test_chart_rayjob(cluster: Cluster):
    c, t0 = cluster, time.monotonic()
    docs = helm_template(*[a for v in VALUES for a in ("-f", str(v))])
    run = apply(c, [d for d in docs if (d["kind"], d["metadata"]["name"]) in TRAINER])
    assert run.train_config()["run"]["world_size"] == 2, run.train_config()["run"]
    shutdown_finished(c)
    try:
        out = run_to_completion(c, run)
    except BaseException:
        run.delete()  # nothing left running for the next scenario (logs stay)
        raise
    out["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    print(f"scenario chart RayJob (trainer.enabled): {out['seconds']} s", flush=True)


def run_to_completion(c: Cluster, run: RayJobRun) -> dict:
    t0 = time.monotonic()
    run.attempt()
    c.rollouts_ready()
    t_up = time.monotonic()
    status = run.follow(run.submit(), 600)
    assert status == "SUCCEEDED", (status, run.log()[-4000:])
    idle_s = rollouts_idle_after_job(c)
    placed = placement(run.log(), run.workers)
    auth_refused(run)  # the chart's authOptions: a submission without the token is refused
    ids = check_ledger(run, resumed=False)
    c.trained_ids[run.name] = ids
    c.finished.append(run)
    return {"job": run.name, "nodes": placed.nodes, "status": status, "trained_ids": len(ids),
            "ray_up_s": round(t_up - t0, 1), "job_s": round(time.monotonic() - t_up, 1),
            "rollouts_idle_after_job_s": idle_s, **check_pushes(c, run, placed.master)}


def rollout_metrics(c: Cluster, pod) -> dict[str, float]:  # noqa: ANN001 (a kube.Pod)
    """The rollout pod's own /metrics (read inside its namespace), unlabelled series only."""
    r = c.python(pod, METRICS, str(pod.ports.get("metrics", 9400)), timeout=30)
    assert r.returncode == 0, r.stderr[-2000:]
    return {m[1]: float(m[2])
            for m in re.finditer(r"^(r3flow_rollout_\w+) (\S+)$", r.stdout, re.M)}


def rollouts_idle_after_job(c: Cluster) -> float:
    """Seconds from the job's end until every rollout pod is idle (the trainer gone, nothing in
    flight), checked to stay idle (no token generated for QUIET_S); at most IDLE_BOUND_S."""
    t_end, pods = time.monotonic(), c.by_name("r3flow-rollout")
    idle: dict[str, float] = {}
    while len(idle) < len(pods):
        assert time.monotonic() - t_end <= IDLE_BOUND_S, (
            f"rollout pods still busy {IDLE_BOUND_S} s after the job ended: "
            f"{ {p.name: rollout_metrics(c, p) for p in pods if p.name not in idle} }")
        for p in pods:
            m = rollout_metrics(c, p)
            if p.name not in idle and m.get("r3flow_rollout_trainer_gone") == 1 and \
                    m.get("r3flow_rollout_inflight_requests") == 0:
                idle[p.name] = time.monotonic() - t_end
        time.sleep(0.5)
    tokens = {p.name: rollout_metrics(c, p)["r3flow_rollout_generated_tokens_total"] for p in pods}
    time.sleep(QUIET_S)
    after = {p.name: rollout_metrics(c, p)["r3flow_rollout_generated_tokens_total"] for p in pods}
    assert after == tokens, f"tokens generated with no trainer: {tokens} -> {after}"
    print(f"rollout pods idle after the job ended: {idle} (bound {IDLE_BOUND_S} s)", flush=True)
    return round(max(idle.values()), 1)
