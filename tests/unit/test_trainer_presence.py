"""Stopping a job stops the spend (docs/operations.md): the store knows whether a trainer is
present (TrainerHeartbeat, with a TTL); once a present trainer is gone (it left, or its presence
expired) the policy-version watch tells rollout workers `trainer_gone`, and they start no new
group until a trainer is present again. Real store (gRPC in this process, embedded Redis)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis

from services.store.client import StoreClient
from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.redis_server import EmbeddedRedis
from services.store.server import StoreServer
from trainer.loop.presence import TrainerPresence


@pytest.fixture
def store(tmp_path) -> Iterator[tuple[StoreClient, TrajectoryStoreCore]]:
    with EmbeddedRedis(tmp_path / "redis") as server:
        cfg = StoreConfig(listen="127.0.0.1:0", key_prefix=f"p{uuid.uuid4().hex[:6]}:",
                          trainer_ttl_seconds=9)
        core = TrajectoryStoreCore(redis.Redis.from_url(server.url), cfg)
        srv = StoreServer(cfg, core).start()
        try:
            with StoreClient(f"127.0.0.1:{srv.port}") as c:
                yield c, core
        finally:
            srv.stop(0)


class Watch:
    """WatchPolicyVersion in a thread: each `trainer_gone` it sees, in order."""

    def __init__(self, client: StoreClient) -> None:
        self.seen: list[bool] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._run, args=(client,), daemon=True).start()

    def _run(self, client: StoreClient) -> None:
        try:
            for msg in client.watch_policy_version(-1):
                with self.changed:
                    self.seen.append(msg.trainer_gone)
                    self.changed.notify_all()
        except grpc.RpcError:  # the test closed the channel
            return

    def until(self, n: int) -> list[bool]:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.seen) >= n, timeout=10), self.seen
            return list(self.seen)


def test_workers_learn_when_the_trainer_leaves_or_expires(store):
    client, core = store
    watch = Watch(client)
    assert watch.until(1) == [False]  # no trainer yet: a new release generates (budget-bound)
    with TrainerPresence(client, "trainer") as presence:
        assert presence.ttl_s == 9 and 0 < core.r.ttl(core.keys.trainer) <= 9
        presence.run_id = "run-a"
        assert not client.stats().trainer_gone
    assert watch.until(2) == [False, True]  # it left: at once, no TTL to wait out
    assert client.stats().trainer_gone
    client.trainer_heartbeat("trainer", "run-b")  # the next job's trainer
    assert watch.until(3) == [False, True, False]
    core.r.delete(core.keys.trainer)  # killed: its presence expires (the key's TTL ran out)
    assert watch.until(4) == [False, True, False, True]


def test_a_trainer_that_fails_still_leaves():
    class Client:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def trainer_heartbeat(self, consumer, run_id="", leaving=False):
            self.calls.append((consumer, run_id, leaving))
            return 30

    client = Client()
    with pytest.raises(RuntimeError), TrainerPresence(client, "t"):
        raise RuntimeError("a rank died")
    assert client.calls == [("t", "", False), ("t", "", True)]
