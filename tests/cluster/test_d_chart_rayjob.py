"""The chart's own trainer RayJob (issue 32 (a)): `helm template` with tests/cluster/values.yaml
and chart-trainer-values.yaml (trainer.enabled, 2 CPU worker pods, the tiny MoE's layout, 3
steps) on the same release; its RayJob and trainer ConfigMap applied (the release's other objects,
its Secrets included, are the ones running). The job runs to completion: one rank per worker
pod, rendezvous at rank 0's pod address, the ledger gapless with each id once, rank 0's pushes
reach both rollout pods and the digests of the last one equal its export; a job submission
without the Ray token is refused (the chart's authOptions)."""

from __future__ import annotations

import json
import time

import pytest
from cluster import REPO, Cluster, helm_template
from rayjob import RayJobRun, apply
from retry import auth_refused, check_ledger, check_pushes, placement, shutdown_finished

pytestmark = pytest.mark.timeout(1800)  # a safety net: a loaded 2-core box is slow
VALUES = [REPO / "tests" / "cluster" / f for f in ("values.yaml", "chart-trainer-values.yaml")]
TRAINER = {("RayJob", "r3flow-trainer"), ("ConfigMap", "r3flow-trainer")}


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
    placed = placement(run.log(), run.workers)
    auth_refused(run)  # the chart's authOptions: a submission without the token is refused
    ids = check_ledger(run, resumed=False)
    c.trained_ids[run.name] = ids
    c.finished.append(run)
    return {"job": run.name, "nodes": placed.nodes, "status": status, "trained_ids": len(ids),
            "ray_up_s": round(t_up - t0, 1), "job_s": round(time.monotonic() - t_up, 1),
            **check_pushes(c, run, placed.master)}
