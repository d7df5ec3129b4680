"""A puller SIGKILLed while holding a leased group: redelivered after the lease, acked once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from store_fixtures import REPO, StoreProcess

from services.store.client import StoreClient
from services.store.synthetic import small_group

LEASE_S = 2


@pytest.mark.timeout(120)
def test_killed_puller_lease_expires_then_redelivered_and_acked_once(
        store_process: StoreProcess) -> None:
    client = StoreClient(store_process.address)
    for traj in small_group("lease", 3):
        client.append_trajectory(traj)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    holder = subprocess.Popen(
        [sys.executable, str(REPO / "tests/integration/store_fixtures.py"), "hold",
         store_process.address, "doomed", str(LEASE_S)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        delivery_id, group_id = holder.stdout.readline().split()
        leased_at = time.monotonic()
    finally:
        holder.kill()  # SIGKILL by pid while it holds the lease
        holder.wait()
    assert group_id == "lease"
    assert client.pull("survivor", 1, lease_seconds=60) == []  # lease still running
    time.sleep(max(0.0, LEASE_S + 0.2 - (time.monotonic() - leased_at)))
    [group] = client.pull("survivor", 1, lease_seconds=60, wait_ms=1000)
    assert (group.delivery_id, group.group_id, group.delivery_count) == (delivery_id, "lease", 2)
    assert sorted(t.trajectory_id for t in group.trajectories) == ["lease/0", "lease/1", "lease/2"]
    assert client.ack("doomed", [delivery_id]) == 0   # the dead puller's lease is gone
    assert client.ack("survivor", [delivery_id]) == 1
    assert client.ack("survivor", [delivery_id]) == 0
    assert client.pull("survivor", 1, wait_ms=200) == []
    stats = client.stats()
    assert (stats.redeliveries, stats.groups_acked, stats.groups_ready) == (1, 1, 0)
