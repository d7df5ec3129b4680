"""The hf backend's RayJob, k8s/tiny-moe-hf.yaml as written, in the box on the same release as
the Megatron job (issue 31): 2 worker pods, one rank each, FSDP2 over gloo; rank 1's pod
SIGKILLed mid-step, the job FAILED naming it, KubeRay's retry on a new RayCluster at new
addresses resumes from the last DCP checkpoint (retry.py); ledger gapless, each id once; rank 0's
pushes reach both rollout pods and the digests of the last one equal its export."""

from __future__ import annotations

import json

import kube
import pytest
from cluster import REPO, Cluster
from rayjob import apply
from retry import kill_and_retry

pytestmark = pytest.mark.timeout(1800)  # a safety net: a loaded 2-core box is slow
SPEC = REPO / "k8s" / "tiny-moe-hf.yaml"


def test_hf_kill_and_retry(cluster: Cluster):
    run = apply(cluster, kube.load_docs(SPEC.read_text()))
    out = kill_and_retry(run)
    print(json.dumps(out))
    print(f"scenario hf ({SPEC.name}): {out['seconds']} s", flush=True)
