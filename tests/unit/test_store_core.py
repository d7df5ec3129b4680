"""TrajectoryStoreCore against a real (embedded) redis-server: dedup, groups, leases, limits."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store.config import StoreConfig
from services.store.control import ControlPlane
from services.store.core import TrajectoryStoreCore
from services.store.errors import CapacityError
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def make_core(url: str, **overrides: object) -> TrajectoryStoreCore:
    cfg = StoreConfig(key_prefix=f"u{uuid.uuid4().hex[:8]}:", **overrides)
    return TrajectoryStoreCore(redis.Redis.from_url(url), cfg)


@pytest.fixture
def core(redis_url: str) -> TrajectoryStoreCore:
    return make_core(redis_url)


def keys_of(core: TrajectoryStoreCore) -> set[str]:
    return {k.decode() for k in core.r.scan_iter(match=core.keys.prefix + "*")}


def append_all(core: TrajectoryStoreCore, trajs: list[trajectory_pb2.Trajectory]) -> None:
    for t in trajs:
        core.append(trajectory_requests(t))


def wire_bytes(t: trajectory_pb2.Trajectory) -> bytes:
    return t.SerializeToString(deterministic=True)


def test_retried_messages_are_no_ops(core: TrajectoryStoreCore) -> None:
    traj = small_group("g", 2)[0]
    reqs = trajectory_requests(traj)
    first = core.append(reqs[:2])  # begin + segment 0, then the connection "drops"
    again = core.append(reqs)      # the client retries the whole stream
    assert (first.accepted, first.duplicates) == (2, 0)
    assert (again.accepted, again.duplicates) == (2, 2)
    assert core.append(reqs).duplicates == 4
    assert core.stats().counters["trajectories_appended"] == 1


def test_group_released_only_when_complete_and_byte_identical(
        core: TrajectoryStoreCore) -> None:
    group = small_group("g", 3)
    append_all(core, group[:2])
    assert core.pull("t0", 5) == []
    append_all(core, group[2:])
    [d] = core.pull("t0", 5)
    assert d.group_id == "g" and d.delivery_count == 1
    got = {t.trajectory_id: wire_bytes(t) for t in d.trajectories}
    assert got == {t.trajectory_id: wire_bytes(t) for t in group}


def test_prompt_routing_is_stored_once_per_group(core: TrajectoryStoreCore) -> None:
    group = small_group("g", 4)
    append_all(core, group)
    fields = core.r.hkeys(core.keys.group("g"))
    assert sum(f.startswith(b"p:") for f in fields) == 1
    # A member whose prompt routing differs (near-tie nondeterminism) keeps its own copy.
    other = small_group("h", 2)
    chunk = other[1].segments[0].routing[0]
    chunk.CopyFrom(small_group("x", 1, seed=7)[0].segments[0].routing[0])
    append_all(core, other)
    assert sum(f.startswith(b"p:") for f in core.r.hkeys(core.keys.group("h"))) == 2
    d = {d.group_id: d for d in core.pull("t", 5)}["h"]
    assert {t.trajectory_id: wire_bytes(t) for t in d.trajectories} == \
        {t.trajectory_id: wire_bytes(t) for t in other}


def test_ack_deletes_payload_and_counts_once(core: TrajectoryStoreCore) -> None:
    before = keys_of(core)
    append_all(core, small_group("g", 2))
    [d] = core.pull("t0", 1)
    assert core.ack("t0", [d.delivery_id]) == 1
    assert core.ack("t0", [d.delivery_id]) == 0
    left = keys_of(core) - before
    assert all(":td:" in k or ":gd:" in k or k.endswith(":stats") for k in left), left
    stats = core.stats()
    assert stats.counters["backlog_tokens"] == 0 and stats.counters["groups_acked"] == 1
    # A trajectory retried after its group was acked is still a duplicate.
    assert core.append(trajectory_requests(small_group("g", 2)[0])).duplicates == 4


def test_expired_lease_is_redelivered_and_only_holder_acks(core: TrajectoryStoreCore) -> None:
    append_all(core, small_group("g", 2))
    [d] = core.pull("a", 1, lease_seconds=1)
    assert core.pull("b", 1) == []          # lease still held
    core.clock.advance(0.9)
    assert core.pull("b", 1) == []          # 0.9 s of a 1 s lease: still held
    core.clock.advance(0.2)
    [d2] = core.pull("b", 1, lease_seconds=30)
    assert d2.delivery_id == d.delivery_id and d2.delivery_count == 2
    assert core.ack("a", [d.delivery_id]) == 0   # lost its lease
    assert core.ack("b", [d.delivery_id]) == 1
    assert core.stats().counters["redeliveries"] == 1


def test_stale_groups_are_dropped_and_counted(redis_url: str) -> None:
    core = make_core(redis_url, max_policy_lag=2)
    append_all(core, small_group("old", 2, policy_version=1))
    append_all(core, small_group("new", 2, seed=3, policy_version=3))
    core.publish_policy_version(4)
    [d] = core.pull("t", 5)
    assert d.group_id == "new"
    stats = core.stats()
    assert stats.dropped_by_reason() == {"stale": 2} and stats.groups_ready == 0


def test_backpressure_refuses_begins_but_accepts_segments(redis_url: str) -> None:
    core = make_core(redis_url, max_backlog_tokens=10, backpressure_retry_ms=250)
    a, b = small_group("g", 2)
    reqs_a = trajectory_requests(a)
    core.append(reqs_a[:1])              # backlog 8 tokens
    core.append(trajectory_requests(b)[:2])  # begin allowed at 8 <= 10; now 8+8+4
    with pytest.raises(CapacityError) as err:
        core.append(trajectory_requests(small_group("h", 1)[0]))
    assert err.value.retry_after_ms == 250 and "max_backlog_tokens" in str(err.value)
    assert core.append(reqs_a[1:]).accepted == 3  # in-flight trajectory still completes


def test_inflight_limit(redis_url: str) -> None:
    core = make_core(redis_url, max_inflight_trajectories=1)
    a, b = small_group("g", 2)
    core.append(trajectory_requests(a)[:1])
    with pytest.raises(CapacityError, match="max_inflight_trajectories"):
        core.append(trajectory_requests(b)[:1])


def test_invalid_stream_writes_nothing(core: TrajectoryStoreCore) -> None:
    before = keys_of(core)
    reqs = trajectory_requests(small_group("g", 2)[0])
    reqs[2].segment.logprobs.append(0.0)
    with pytest.raises(ValueError, match=r"^segment.logprobs: .*trajectory_id='g/0'"):
        core.append(reqs)
    assert keys_of(core) == before


@pytest.mark.parametrize("policy, released", [("drop", 0), ("release_partial", 1)])
def test_group_timeout(redis_url: str, policy: str, released: int) -> None:
    core = make_core(redis_url, group_timeout_seconds=1.0, group_timeout_policy=policy)
    group = small_group("g", 3)
    append_all(core, group[:2])
    core.append(trajectory_requests(group[2])[:2])  # third never finishes
    assert core.reap_timeouts(now=time.time() + 5) == 1
    pulled = core.pull("t", 5)
    assert len(pulled) == released
    if released:
        assert len(pulled[0].trajectories) == 2
        core.ack("t", [pulled[0].delivery_id])
    dropped = core.stats().dropped_by_reason()["group_timeout"]
    assert dropped == (1 if released else 3)
    assert core.stats().counters["backlog_tokens"] == 0
    assert core.stats().counters["inflight"] == 0


def test_aborted_trajectories_are_never_delivered(core: TrajectoryStoreCore) -> None:
    group = small_group("g", 2)
    group[1].finish_reason = trajectory_pb2.FINISH_REASON_ABORTED
    append_all(core, group)
    [d] = core.pull("t", 1)
    assert [t.trajectory_id for t in d.trajectories] == ["g/0"]
    assert core.stats().dropped_by_reason() == {"aborted": 1}


def test_policy_version_is_monotonic(core: TrajectoryStoreCore) -> None:
    assert core.publish_policy_version(5) == 5
    assert core.publish_policy_version(3) == 5
    assert core.policy_version() == 5


def test_workers_and_weight_sync_plans(core: TrajectoryStoreCore) -> None:
    control = ControlPlane(core.r, core.keys, worker_ttl_seconds=1)
    control.register_worker(store_pb2.WorkerInfo(worker_id="w1", host="h", world_size=2))
    assert [w.worker_id for w in control.list_workers()] == ["w1"]
    with pytest.raises(ValueError, match="^world_size"):
        control.register_worker(store_pb2.WorkerInfo(worker_id="w2"))
    control.publish_weight_sync(store_pb2.WeightSyncPlan(version=2, master_port=1234))
    control.publish_weight_sync(store_pb2.WeightSyncPlan(version=2, master_port=1234))
    with pytest.raises(ValueError, match="^version: 1 is older"):
        control.publish_weight_sync(store_pb2.WeightSyncPlan(version=1))
    assert control.latest_weight_sync().master_port == 1234
    assert 0 < core.r.pttl(core.keys.worker("w1")) <= 1000  # the entry lives worker_ttl_seconds
    core.r.pexpireat(core.keys.worker("w1"), 1)  # ... and then it is gone (Redis' expiry)
    assert control.list_workers() == []


def test_unregister_drops_a_worker_at_once(core: TrajectoryStoreCore) -> None:
    control = ControlPlane(core.r, core.keys, worker_ttl_seconds=60)
    for wid in ("w1", "w2"):
        control.register_worker(store_pb2.WorkerInfo(worker_id=wid, host="h", world_size=1))
    assert control.unregister_worker("w1") is True
    assert [w.worker_id for w in control.list_workers()] == ["w2"]
    assert control.unregister_worker("w1") is False  # gone already: not an error
    with pytest.raises(ValueError, match="^worker_id"):
        control.unregister_worker("")


def test_delivery_count_grows_with_each_redelivery(core: TrajectoryStoreCore) -> None:
    append_all(core, small_group("g", 1))
    counts = []
    for consumer in ("a", "b", "c"):
        [d] = core.pull(consumer, 1, lease_seconds=1)
        counts.append(d.delivery_count)
        core.clock.advance(1.05)
    assert counts == [1, 2, 3]
    assert core.stats().counters["redeliveries"] == 2
