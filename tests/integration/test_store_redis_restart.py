"""redis-server SIGKILLed and restarted from its AOF between append and pull: nothing that the
store acknowledged to a client is lost, and the store process rides through the outage."""

from __future__ import annotations

import pytest
from store_fixtures import StoreProcess

from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group


def _wire(t) -> bytes:  # noqa: ANN001
    return t.SerializeToString(deterministic=True)


@pytest.mark.timeout(120)
def test_redis_crash_and_aof_restart_loses_nothing_acked(
        store_redis: EmbeddedRedis, store_process: StoreProcess) -> None:
    client = StoreClient(store_process.address, max_backoff_s=1.0)
    groups = [small_group(f"aof-{i}", 4, seed=100 + i) for i in range(10)]
    for group in groups[:5]:
        for traj in group:
            client.append_trajectory(traj)  # returned OK: the store acknowledged these
    client.publish_policy_version(2)
    store_redis.restart(hard=True)  # SIGKILL; AOF fsync=always, then reload on the same port
    for group in groups[5:]:
        for traj in group:
            client.append_trajectory(traj)
    pulled = client.pull("trainer", max_groups=20, lease_seconds=60, wait_ms=1000)
    got = {t.trajectory_id: _wire(t) for g in pulled for t in g.trajectories}
    assert got == {t.trajectory_id: _wire(t) for g in groups for t in g}
    assert client.ack("trainer", [g.delivery_id for g in pulled]) == 10
    stats = client.stats()
    assert (stats.policy_version, stats.trajectories_appended, stats.backlog_tokens) == (2, 40, 0)


@pytest.mark.timeout(60)
def test_requests_during_redis_outage_are_unavailable_then_retried(
        store_redis: EmbeddedRedis, store_process: StoreProcess) -> None:
    import threading

    client = StoreClient(store_process.address, max_retries=20, max_backoff_s=0.5)
    store_redis.kill()
    timer = threading.Timer(1.5, store_redis.start)
    timer.start()
    try:
        for traj in small_group("outage", 2, seed=9):
            client.append_trajectory(traj)  # UNAVAILABLE while Redis is down, then retried
    finally:
        timer.join()
    assert client.retries > 0
    [group] = client.pull("trainer", 1, wait_ms=1000)
    assert group.group_id == "outage"
    assert client.ack("trainer", [group.delivery_id]) == 1
