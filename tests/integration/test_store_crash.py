"""1,000 trajectories from 4 client processes while the store is SIGKILLed and restarted twice:
the trainer side then pulls exactly those 1,000, byte-identical, none twice. Clients 0-1 send
one Append stream per trajectory, clients 2-3 one AppendBatch per 5 groups' members (as a
rollout worker sends groups that finished together), so a kill can land mid-batch too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis
from store_fixtures import REPO, StoreProcess, crash_group, wait_until

from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis

CLIENTS, GROUPS = 4, 250  # group g holds member i from client i: 4 x 250 = 1,000 trajectories
BATCH = {0: 1, 1: 1, 2: 5, 3: 5}  # client -> groups per append call


def _start_clients(address: str) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    script = str(REPO / "tests/integration/store_fixtures.py")
    return [subprocess.Popen([sys.executable, script, "append", address, str(i), str(GROUPS),
                              str(BATCH[i])],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
            for i in range(CLIENTS)]


def _appended(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return int(client.hget("r3f:stats", "trajectories_appended") or 0)
    finally:
        client.close()


def _drain(address: str) -> tuple[dict[str, bytes], list[str]]:
    """Pull and ack until empty; returns trajectory id -> wire bytes, and every delivery id."""
    got: dict[str, bytes] = {}
    deliveries: list[str] = []
    with StoreClient(address) as client:
        while groups := client.pull("trainer", max_groups=50, lease_seconds=60, wait_ms=500):
            for g in groups:
                for t in g.trajectories:
                    assert t.trajectory_id not in got, f"{t.trajectory_id} delivered twice"
                    got[t.trajectory_id] = t.SerializeToString(deterministic=True)
            deliveries += [g.delivery_id for g in groups]
            assert client.ack("trainer", [g.delivery_id for g in groups]) == len(groups)
    return got, deliveries


@pytest.mark.timeout(240)
def test_store_sigkilled_twice_loses_and_duplicates_nothing(
        store_redis: EmbeddedRedis, tmp_path) -> None:  # noqa: ANN001
    store = StoreProcess(store_redis.url, tmp_path).start()
    clients = _start_clients(store.address)
    try:
        for threshold in (250, 600):
            wait_until(lambda t=threshold: _appended(store_redis.url) >= t, 90, f"{threshold}")
            streaming = sum(c.poll() is None for c in clients)
            assert streaming > 0, f"every client finished before the kill at {threshold}"
            store.restart()  # SIGKILL by pid, then start again on the same port
        outputs = [json.loads(c.communicate(timeout=120)[0]) for c in clients]
        assert [c.returncode for c in clients] == [0] * CLIENTS
        got, deliveries = _drain(store.address)
        stats = StoreClient(store.address).stats()
    finally:
        for c in clients:
            c.kill()
        store.stop()
    expected = {t.trajectory_id: t.SerializeToString(deterministic=True)
                for g in range(GROUPS) for t in crash_group(g)}
    assert len(got) == 1000 and got.keys() == expected.keys()
    assert all(got[k] == expected[k] for k in expected), "pulled bytes differ from appended"
    assert len(deliveries) == len(set(deliveries)) == GROUPS
    assert sum(o["retries"] for o in outputs) > 0, "the kills never hit a client"
    # Batching clients make 5x fewer calls but still run at the first kill (250 of 1,000).
    assert sum(o["retries"] for i, o in enumerate(outputs) if BATCH[i] > 1) > 0, \
        "the kills never hit a batching client"
    assert sum(o["accepted"] + o["duplicates"] for o in outputs) == 4 * 1000
    assert (stats.trajectories_appended, stats.groups_acked) == (1000, GROUPS)
    assert stats.backlog_tokens == 0 and stats.redeliveries == 0
