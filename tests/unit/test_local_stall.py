"""`r3flow local` stops a stalled run naming the component and the cause (issue 59): each cause
provoked on a real store core (embedded redis-server) and a real /health endpoint."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest

from services.common.metrics import MetricsServer
from services.common.pb.r3flow.v1 import store_pb2
from services.local.budget import Budget, Stalled
from services.local.config import LocalConfig
from services.local.monitor import RunMonitor, StallWatch, StoreFacts, stall_cause
from services.store.config import StoreConfig
from services.store.control import ControlPlane
from services.store.core import TrajectoryStoreCore
from services.store.errors import CapacityError
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.server import stats_to_proto
from services.store.synthetic import small_group


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


class Store:
    """A store core, its control plane and its metrics registry, read as `r3flow local` does."""

    def __init__(self, url: str, **cfg: object) -> None:
        self.registry = CollectorRegistry()
        config = StoreConfig(key_prefix=f"s{uuid.uuid4().hex[:8]}:", **cfg)
        self.core = TrajectoryStoreCore(redis.Redis.from_url(url), config, self.registry)
        self.control = ControlPlane(self.core.r, self.core.keys, 30)

    def facts(self) -> StoreFacts:
        stats = stats_to_proto(self.core.stats())  # first: it refreshes the gauges
        return StoreFacts.read(stats, self.control.list_workers(),
                               generate_latest(self.registry).decode())

    def register(self) -> None:
        self.control.register_worker(store_pb2.WorkerInfo(worker_id="rollout-0", host="h",
                                                             world_size=1))

    def append_group(self, gid: str, seed: int = 0) -> None:
        for t in small_group(gid, 2, seed=seed):
            self.core.append(trajectory_requests(t))


def test_no_worker_connected(redis_url: str) -> None:
    store = Store(redis_url)
    facts = store.facts()
    assert stall_cause({}, facts, facts) == (
        "rollout", "no rollout worker connected (none registered with the store)")


def test_trainer_not_pulling(redis_url: str) -> None:
    store = Store(redis_url)
    store.register()
    then = store.facts()
    store.append_group("g")
    component, cause = stall_cause({}, then, store.facts())
    assert component == "trainer" and cause.startswith("trainer not pulling: 1 groups ready")
    store.core.pull("trainer", 1)  # it pulls: no longer the cause
    assert stall_cause({}, then, store.facts())[0] != "trainer"


def test_budget_full(redis_url: str) -> None:
    """Workers stuck mid-group hold the admission budget: new groups are refused."""
    store = Store(redis_url, max_backlog_tokens=10)
    store.register()
    begun = trajectory_requests(small_group("stuck", 2)[0])
    store.core.append(begun[:2])  # begun, 12 tokens, never finished
    then = store.facts()
    with pytest.raises(CapacityError):
        store.append_group("next", seed=1)
    component, cause = stall_cause({}, then, store.facts())
    assert component == "store"
    assert cause == ("budget full: 1 requests refused by the admission budget "
                     "(max_backlog_tokens); held: 12 tokens undelivered, 0 delivered and not yet "
                     "acked, 1 groups open, 0 leased")


def test_engine_dead(tmp_path: Path) -> None:
    """A rollout worker whose engine died answers 503 on /health: it is named first."""
    healthy = {"ok": True}
    server = MetricsServer(CollectorRegistry(), health_fn=lambda: healthy["ok"]).start()
    try:
        monitor = RunMonitor(LocalConfig(), tmp_path)
        monitor.add("rollout-0", server.port)
        assert not monitor.unhealthy("rollout-0")
        healthy["ok"] = False
        assert monitor.unhealthy("rollout-0")
    finally:
        server.stop()
    facts = StoreFacts(0, 0, 0, 0, 1, {}, 0.0, 0.0)
    dead = {"rollout-0": "engine dead (its /health reports it; see its log)"}
    assert stall_cause(dead, facts, facts) == ("rollout-0", dead["rollout-0"])


def test_stall_is_several_recent_step_times_and_names_its_cause() -> None:
    facts = StoreFacts(0, 0, 0, 0, 0, {}, 0.0, 0.0)
    reads = []
    watch = StallWatch(lambda: reads.append(1) or facts)
    assert watch.idle([100.0], now=0.0) is None  # one step: the boot budget's business
    assert watch.idle([100.0], now=1000.0) is None
    assert watch.idle([100.0, 130.0], now=1000.0) is None  # a step: facts read
    assert watch.limit([100.0, 130.0]) == 150.0  # 5 x 30 s
    assert watch.idle([100.0, 130.0], now=1149.0) is None
    assert watch.idle([100.0, 130.0], now=1151.0) == pytest.approx(151.0)
    assert watch.limit([0.0, 10.0, 50.0, 60.0]) == 200.0  # the longest recent gap counts
    assert watch.limit([0.0, 1.0]) == 120.0  # the floor
    assert len(reads) == 2
    component, cause = watch.cause({})
    stalled = Stalled(Budget(20, 480.0, 15.0, True), 2, component, cause, 151.0)
    assert str(stalled) == ("stalled at GRPO step 2 of 20 (no step for 151 s): rollout: no "
                            "rollout worker connected (none registered with the store)")
