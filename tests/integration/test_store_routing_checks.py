"""Deferred routing payload walks (services/store/routing_checks.py) against a real Redis: a
stream's payloads are walked together after its other checks, yet the error reported is the
one a message-by-message check finds first, and a refused stream writes nothing.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator

import pytest
import redis

from services.common.pb.r3flow.v1 import routing_pb2, store_pb2
from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import small_group

Reqs = list[store_pb2.AppendRequest]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


def make_core(url: str, threads: int = 2) -> TrajectoryStoreCore:
    cfg = StoreConfig(key_prefix=f"rc{uuid.uuid4().hex[:8]}:", routing_check_threads=threads)
    return TrajectoryStoreCore(redis.Redis.from_url(url), cfg)


def keys_of(core: TrajectoryStoreCore) -> set[bytes]:
    return set(core.r.scan_iter(match=core.keys.prefix + "*"))


def group_stream() -> Reqs:
    """Two trajectories of one group in one stream: begin, segment 0, segment 1, finish each."""
    return [r for t in small_group("g", 2, seed=3) for r in trajectory_requests(t)]


def corrupt_payload(chunk: routing_pb2.RoutedExperts) -> None:
    """Payload bytes zeroed; the wire CRC-32 is recomputed, so only the walk can tell."""
    chunk.data = chunk.data[:32] + bytes(len(chunk.data) - 32)
    chunk.checksum = zlib.crc32(chunk.data)


def refused(core: TrajectoryStoreCore, reqs: Reqs) -> str:
    before = keys_of(core)
    with pytest.raises(ValueError) as err:
        core.append(reqs)
    assert keys_of(core) == before  # nothing of the stream was written
    return str(err.value)


@pytest.mark.parametrize("threads", [1, 3])
def test_valid_stream_is_stored_whatever_the_thread_count(redis_url: str, threads: int) -> None:
    core = make_core(redis_url, threads)
    result = core.append(group_stream())
    assert (result.accepted, result.duplicates) == (8, 0)
    assert core.stats().groups_ready == 1


def test_an_earlier_payload_error_wins_over_a_later_error(redis_url: str) -> None:
    reqs = group_stream()
    corrupt_payload(reqs[1].segment.routing[1])   # g/0, segment 0, response rows
    reqs[6].segment.logprobs.append(0.0)           # g/1, segment 1: found first by the pass
    message = refused(make_core(redis_url), reqs)
    assert message.startswith("segment.routing[1].data: routing blob: checksum mismatch")
    assert "trajectory_id='g/0' sequence_number=1" in message


def test_a_later_payload_error_loses_to_an_earlier_error(redis_url: str) -> None:
    reqs = group_stream()
    reqs[2].segment.logprobs.append(0.0)            # g/0, segment 1
    corrupt_payload(reqs[6].segment.routing[0])     # g/1, segment 1
    message = refused(make_core(redis_url), reqs)
    assert message.startswith("segment.logprobs: ")
    assert "trajectory_id='g/0' sequence_number=2" in message


def test_payload_error_wins_over_a_shape_error_of_the_same_chunk(redis_url: str) -> None:
    """Decode-then-compare order of routing_from_proto: a blob with trailing bytes and a
    shape that disagrees with its header reports the blob."""
    reqs = group_stream()
    chunk = reqs[2].segment.routing[0]
    chunk.data += b"\0\0\0\0"
    chunk.checksum = zlib.crc32(chunk.data)
    chunk.shape[0] += 1
    message = refused(make_core(redis_url), reqs)
    assert message.startswith("segment.routing[0].data: routing blob: 4 trailing bytes")


def test_only_payload_errors_are_reported_in_stream_order(redis_url: str) -> None:
    reqs = group_stream()
    corrupt_payload(reqs[6].segment.routing[0])
    corrupt_payload(reqs[2].segment.routing[0])
    message = refused(make_core(redis_url, threads=4), reqs)
    assert message.startswith("segment.routing[0].data: ")
    assert "trajectory_id='g/0' sequence_number=2" in message


def test_store_refuses_routing_of_a_model_it_does_not_serve(redis_url: str) -> None:
    cfg = StoreConfig(key_prefix=f"rc{uuid.uuid4().hex[:8]}:",
                      models=[{"name": "tiny-k3", "num_experts": 8, "top_k": 3}])
    core = TrajectoryStoreCore(redis.Redis.from_url(redis_url), cfg)
    message = refused(core, group_stream())  # top-2 routing
    assert "num_experts=8, top_k=2; registered models: tiny-k3 (num_experts=8, top_k=3)" in message


def test_a_quarantined_group_is_counted_as_dropped_by_reason(redis_url: str) -> None:
    core = make_core(redis_url)
    core.append(group_stream())
    (d,) = core.pull("trainer-0", 1, lease_seconds=60, wait_ms=0)
    with pytest.raises(ValueError, match="dropped.reason"):
        core.drop("trainer-0", d.delivery_id, "Bad Reason!", 2)
    assert core.drop("trainer-0", d.delivery_id, "routing_agreement", 2) == 1
    assert core.drop("trainer-0", d.delivery_id, "routing_agreement", 2) == 0  # a repeat
    stats = core.stats()
    assert stats.dropped_by_reason() == {"routing_agreement": 2}
    assert core.pull("trainer-0", 1, lease_seconds=60, wait_ms=0) == []
