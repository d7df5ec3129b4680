"""The session's cluster in a box (docs/cluster-test.md): the chart's release (Redis, the store,
two rollout pods) rendered from tests/cluster/values.yaml and started once; the scenarios
(test_*.py, run in file order) apply their RayJobs on top of it, and test_z_accounting.py
checks the store's books over all of them at the end."""

from __future__ import annotations

import os
import time

import box as bx
import pytest
from cluster import HELM, Cluster


def _netns_or_skip() -> None:
    why = bx.can_create_netns()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"cluster test needs network namespaces: {why}")
        pytest.skip(f"cluster test needs network namespaces: {why}")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    _netns_or_skip()
    if not HELM.exists():
        pytest.fail("helm is missing: run `make test-cluster` (tests/cluster/setup.sh fetches it)")
    bx.clean_leftovers()
    t0 = time.monotonic()
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.up()
        c.start_release()
        print(f"\nrelease started in {time.monotonic() - t0:.1f} s (engines loading)", flush=True)
        yield c
    finally:
        c.box.close()
        assert not bx.leftovers(), f"left behind: {bx.leftovers()}"
