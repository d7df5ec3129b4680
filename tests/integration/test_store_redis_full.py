"""Redis at its maxmemory (policy noeviction) refuses writes with OOM: the store answers
RESOURCE_EXHAUSTED naming the limit (with a retry hint, like backpressure), stores nothing of
the refused message, and still lets trainers pull and ack, which is what frees the memory."""

from __future__ import annotations

import grpc
import pytest
import redis
from store_fixtures import StoreProcess

from services.store.client import StoreClient
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group

pytestmark = pytest.mark.timeout(180)
HEADROOM = 384 << 10  # bytes above what an empty store uses: a few dozen groups


def _group(i: int) -> list:
    return small_group(f"full-{i}", 4, prompt_len=64, segment_lengths=(96, 96), layers=8,
                       seed=i)


@pytest.fixture()
def tiny_redis(tmp_path):
    server = EmbeddedRedis(tmp_path / "redis").start()
    yield server
    server.stop()


def _fill(client: StoreClient, limit: int = 2000) -> tuple[list[int], grpc.RpcError]:
    accepted = []
    for i in range(limit):
        try:
            client.append_trajectories(_group(i))
        except grpc.RpcError as e:
            return accepted, e
        accepted.append(i)
    raise AssertionError(f"{limit} groups fit under maxmemory")


def _backlog_matches_redis(r: redis.Redis) -> None:
    # Every script ran whole or not at all: the backlog counter equals the tokens the stored
    # trajectories hold (a half-run BEGIN or SEGMENT would break the sum).
    stats = {k.decode(): int(v) for k, v in r.hgetall("r3f:stats").items()}
    tokens = sum(int(r.hget(k, "tokens") or 0) for k in r.scan_iter("r3f:t:*", count=1000)
                 if r.type(k) == b"hash")
    assert stats.get("backlog_tokens", 0) == tokens


# reserve 0: Redis itself refuses (OOM inside a Lua script, mapped by the store); the default
# reserve: the store refuses new trajectories first, keeping room for pulls and acks.
@pytest.mark.parametrize("reserve", [0.0, 0.05])
def test_full_redis_is_a_store_error_and_nothing_half_written(tiny_redis, tmp_path, reserve):
    store = StoreProcess(tiny_redis.url, tmp_path, max_policy_lag=None,
                         redis_memory_reserve=reserve).start()
    r = redis.Redis.from_url(tiny_redis.url)
    try:
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) + HEADROOM)
        with StoreClient(store.address, max_backpressure_wait_s=0) as client:
            accepted, err = _fill(client)
            assert len(accepted) >= 3
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
            assert "Redis is full" in err.details() and "maxmemory" in err.details()
            assert "command not allowed" not in err.details()
            # Which check refused: Redis inside a commit script, or the store's reserve.
            assert err.details().startswith("begin (store" if reserve else "append [")
            assert dict(err.trailing_metadata() or ()).get("retry-after-ms")
            _backlog_matches_redis(r)

            got = []
            if reserve:  # still full: trainers can pull and ack, and acking frees memory
                got = client.pull("trainer", 2, lease_seconds=60)
                assert len(got) == 2
                assert client.ack("trainer", [g.delivery_id for g in got]) == 2

            # Room again: the refused group goes in whole (its stored part counted as
            # duplicates), and every accepted group comes out complete.
            r.config_set("maxmemory", 0)
            refused = len(accepted)
            client.append_trajectories(_group(refused))
            _backlog_matches_redis(r)
            pulled = {}
            while batch := client.pull("trainer", 16, lease_seconds=60):
                pulled.update({g.group_id: g for g in batch})
            want = {f"full-{i}" for i in [*accepted, refused]} - {g.group_id for g in got}
            assert set(pulled) == want
            for g in pulled.values():
                assert len(g.trajectories) == 4
    finally:
        r.close()
        store.stop()
