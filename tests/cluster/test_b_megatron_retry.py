"""The named Megatron run, k8s/qwen3-30b-a3b-grpo-r3.yaml, in the box with the tiny override of
named_spec.py (only the fields that size it; labels, submitterPodTemplate, auth, Secrets and
volumes as written): rank 1's pod SIGKILLed mid-step, the job FAILED naming it, KubeRay's retry
on a new RayCluster at new addresses resumes from the last checkpoint (retry.py); plus Ray token
auth: a job submission without the cluster's token is refused by the head's dashboard (the
test's own submissions carry it, from the Secret)."""

from __future__ import annotations

import json

import kube
import named_spec
import pytest
from cluster import REPO, Cluster
from rayjob import apply
from retry import auth_refused, kill_and_retry

pytestmark = pytest.mark.timeout(1800)  # a safety net: a loaded 2-core box is slow
SPEC = REPO / "k8s" / named_spec.SPEC


def test_megatron_kill_and_retry(cluster: Cluster):
    run = apply(cluster, named_spec.tiny(kube.load_docs(SPEC.read_text())))
    out = kill_and_retry(run, between=lambda: auth_refused(run))
    print(json.dumps(out))
    print(f"scenario megatron ({SPEC.name}, tiny override): {out['seconds']} s", flush=True)
