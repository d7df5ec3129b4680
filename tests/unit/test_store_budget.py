"""The store's backlog budget in groups (max_groups_ahead), dead-lettering after
max_redeliveries, and lease renewal by the holder's own session (real embedded redis-server)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from services.common.pb.r3flow.v1 import store_pb2
from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.dead_letter import read_dead_letters
from services.store.errors import CapacityError
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def make_core(url: str, **overrides: object) -> TrajectoryStoreCore:
    cfg = StoreConfig(key_prefix=f"b{uuid.uuid4().hex[:8]}:", **overrides)
    return TrajectoryStoreCore(redis.Redis.from_url(url), cfg)


def append_group(core: TrajectoryStoreCore, gid: str, size: int = 2, seed: int = 0) -> None:
    for t in small_group(gid, size, seed=seed):
        core.append(trajectory_requests(t))


def test_new_groups_wait_for_the_budget_begun_ones_complete(redis_url: str) -> None:
    core = make_core(redis_url, max_groups_ahead=2, backpressure_retry_ms=250)
    append_group(core, "ready")                      # 1 ready
    a, b = small_group("open", 2, seed=1)
    core.append(trajectory_requests(a))              # 1 open: 2 ahead = the budget
    with pytest.raises(CapacityError, match="max_groups_ahead=2") as err:
        core.append(trajectory_requests(small_group("new", 1, seed=2)[0]))
    assert err.value.retry_after_ms == 250 and err.value.reason == "groups_ahead"
    assert core.append(trajectory_requests(b)).accepted == 4  # a begun group completes
    stats = core.stats()
    assert (stats.groups_ready, stats.groups_open) == (2, 0)
    delivered = core.pull("t", 1)                    # delivered, not acked: not ahead any more
    append_group(core, "new", 1, seed=2)
    with pytest.raises(CapacityError):
        append_group(core, "newer", 1, seed=3)
    core.ack("t", [d.delivery_id for d in delivered])
    assert core.stats().counters["groups_acked"] == 1


def test_group_redelivered_past_the_limit_is_dead_lettered(redis_url: str) -> None:
    core = make_core(redis_url, max_redeliveries=2)
    append_group(core, "poison")
    append_group(core, "good", seed=5)
    counts = []
    for consumer in ("a", "b", "c"):  # 1 delivery + 2 redeliveries, none acked
        got = {d.group_id: d for d in core.pull(consumer, 2, lease_seconds=1)}
        counts.append(got["poison"].delivery_count)
        if "good" in got:
            core.ack(consumer, [got["good"].delivery_id])
        core.clock.advance(1.05)
    assert counts == [1, 2, 3]
    assert core.pull("d", 2, lease_seconds=1) == []  # never delivered again
    stats = core.stats()
    assert stats.counters["groups_dead_lettered"] == 1
    assert stats.dropped_by_reason() == {"dead_letter": 2} and stats.groups_pending == 0
    [rec] = read_dead_letters(core.r, core.keys).values()
    assert rec.group_id == "poison" and rec.deliveries == 3 and rec.last_consumer == "c"
    assert "max_redeliveries=2" in rec.reason and sorted(rec.trajectory_ids) == [
        "poison/0", "poison/1"]
    kept = store_pb2.PulledGroup.FromString(core.r.get(core.keys.dead_letter_group("poison")))
    assert kept.group_id == "poison" and len(kept.trajectories) == 2


def test_own_session_renews_its_lease_without_counting(redis_url: str) -> None:
    """A trainer waiting for the rest of its batch takes its expired groups back: renewed, not
    redelivered; a restarted trainer (a new session) counts."""
    core = make_core(redis_url, max_redeliveries=0)
    append_group(core, "g")
    for _ in range(3):
        [d] = core.pull("t", 1, lease_seconds=1, session="s1")
        assert d.delivery_count == 1
        core.clock.advance(1.05)
    assert core.stats().counters.get("redeliveries", 0) == 0
    assert core.pull("t", 1, lease_seconds=1, session="s2") == []  # 2nd delivery > 0 allowed
    assert core.stats().counters["groups_dead_lettered"] == 1


def test_a_renewal_is_never_dropped_stale(redis_url: str) -> None:
    """The holder took the group before the version moved (a batch waiting across a resync
    push, or trained and waiting for its checkpoint): only another session's pull drops it."""
    core = make_core(redis_url, max_policy_lag=1)
    append_group(core, "g")
    [d] = core.pull("t", 1, lease_seconds=1, session="s1")
    core.publish_policy_version(5)
    core.clock.advance(1.05)
    [again] = core.pull("t", 1, lease_seconds=1, session="s1")
    assert again.delivery_id == d.delivery_id
    core.clock.advance(1.05)
    assert core.pull("t", 1, session="s2") == []
    assert core.stats().dropped_by_reason() == {"stale": 2}


def test_delivered_unacked_groups_never_block_admission(redis_url: str, caplog) -> None:
    """Issue 59's stall replayed: a budget of two groups a step (2 x 2 x 15 tokens), a trainer
    that pulls each step and acks only at its checkpoint (checkpoint_every 1000: never here).
    Counting delivered groups against the budget refused every append after two steps."""
    core = make_core(redis_url, max_backlog_tokens=59)
    for step in range(5):
        append_group(core, f"s{step}a", seed=2 * step)  # admitted (CapacityError otherwise)
        append_group(core, f"s{step}b", seed=2 * step + 1)
        with caplog.at_level("WARNING", logger="services.store.append"), \
                pytest.raises(CapacityError, match="max_backlog_tokens=59") as err:
            append_group(core, f"s{step}c", seed=99)  # the budget holds one step ahead
        assert err.value.reason == "backlog"
        assert len(core.pull("trainer", 2)) == 2  # delivered, none acked
    stats = core.stats().counters
    assert (stats["backlog_tokens"], stats["delivered_tokens"]) == (5 * 60, 5 * 60)
    # the first refusal said why, with the numbers (later ones within a minute are counted)
    [warning] = [r.getMessage() for r in caplog.records if "appends refused" in r.getMessage()]
    assert "60 tokens undelivered, 0 delivered and not yet acked" in warning


def test_unacked_bound_refuses_new_groups_until_an_ack(redis_url: str) -> None:
    """max_unacked_tokens: at it a pull gets no new group (refused when it would get none);
    groups whose lease expired are still redelivered; an ack makes room."""
    core = make_core(redis_url, max_unacked_tokens=60)
    for i in range(4):
        append_group(core, f"g{i}", seed=i)
    first = core.pull("t", 2, lease_seconds=1)
    assert len(first) == 2 and core.stats().counters["delivered_tokens"] == 60
    with pytest.raises(CapacityError, match="max_unacked_tokens=60") as err:
        core.pull("t", 2)
    assert err.value.reason == "unacked"
    core.clock.advance(1.05)  # a crashed trainer's groups: redelivered whatever the bound
    again = core.pull("t2", 4)
    assert sorted(d.group_id for d in again) == sorted(d.group_id for d in first)
    assert core.ack("t2", [d.delivery_id for d in again]) == 2
    assert core.stats().counters["delivered_tokens"] == 0
    assert len(core.pull("t2", 4)) == 2  # the other two, now admitted to delivery
