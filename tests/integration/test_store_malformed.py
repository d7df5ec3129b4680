"""Every malformed-append rule, through a real store process: INVALID_ARGUMENT naming the field
(RESOURCE_EXHAUSTED for an oversized message), and no new keys left in Redis."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
from store_fixtures import StoreProcess, redis_keys

from services.common.pb.r3flow.v1 import store_pb2
from services.common.wire import routing_to_proto
from services.store.client import StoreClient
from services.store.parts import trajectory_requests
from services.store.redis_server import EmbeddedRedis
from services.store.synthetic import random_routing, small_group

PREFIX = "bad:"
Reqs = list[store_pb2.AppendRequest]


@pytest.fixture(scope="module")
def strict_store(store_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[StoreProcess]:  # noqa: ANN001
    proc = StoreProcess(store_redis.url, tmp_path_factory.mktemp("strict"), key_prefix=PREFIX,
                        max_message_bytes=16384, max_tokens_per_trajectory=64).start()
    yield proc
    proc.stop()


def _reqs() -> Reqs:
    """begin, segment 0 (P=8, n0=4: prompt chunk + rows [8,11)), segment 1 (rows [11,14)), finish."""
    return trajectory_requests(small_group("m", 2, seed=5)[0])


def _chunk(rows: int, start: int, layers: int = 2, topk: int = 2, experts: int = 8,
           layer_ids: list[int] | None = None):  # noqa: ANN202
    ids = random_routing(rows, layers, topk, experts, np.random.default_rng(start))
    return routing_to_proto(ids, experts, start_row=start, layer_ids=layer_ids or list(range(layers)))


def _seg(j: int, fn: Callable) -> Callable[[Reqs], Reqs]:  # noqa: ANN001
    def mutate(reqs: Reqs) -> Reqs:
        fn(reqs[1 + j].segment)
        return reqs
    return mutate


def _recrc(chunk) -> None:  # noqa: ANN001
    chunk.checksum = zlib.crc32(chunk.data)


def _crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return ~crc & 0xFFFFFFFF


def _ids_beyond_experts(seg) -> None:  # noqa: ANN001
    """A well-formed blob of ids in [0, 16) whose header (and CRC-32C) claims 8 experts."""
    ids = random_routing(3, 2, 2, 16, np.random.default_rng(3))
    ids[0, 0] = [14, 15]
    blob = bytearray(routing_to_proto(ids, 16, start_row=11, layer_ids=[0, 1]).data)
    struct.pack_into("<H", blob, 8, 8)                      # num_experts u16 at offset 8
    struct.pack_into("<I", blob, 28, _crc32c(bytes(blob[:28] + blob[32:])))
    seg.routing[0].data = bytes(blob)
    _recrc(seg.routing[0])


def _second_member_other_size(reqs: Reqs) -> Reqs:
    other = trajectory_requests(small_group("m", 2, seed=5)[1])
    other[0].begin.group_size = 3
    return reqs + other


CASES: list[tuple[str, Callable[[Reqs], Reqs], str]] = [
    ("empty id", lambda r: [r[0].__setattr__("trajectory_id", ""), r][1], "trajectory_id"),
    ("no body", lambda r: [r[1].ClearField("segment"), r][1], "body"),
    ("begin at seq 1", lambda r: [r[1].begin.CopyFrom(r[0].begin), r][1], "sequence_number"),
    ("gap", lambda r: [r[0], r[2], r[3]], "sequence_number"),
    ("no begin", lambda r: r[1:], "sequence_number"),
    ("group size 0", lambda r: [r[0].begin.__setattr__("group_size", 0), r][1],
     "begin.group_size"),
    ("group size differs", _second_member_other_size, "begin.group_size"),
    ("empty prompt", lambda r: [r[0].begin.ClearField("prompt_token_ids"), r][1],
     "begin.prompt_token_ids"),
    ("prompt over limit", lambda r: [r[0].begin.prompt_token_ids.extend([1] * 60), r][1],
     "begin.prompt_token_ids"),
    ("segment index", _seg(1, lambda s: s.__setattr__("index", 5)), "segment.index"),
    ("logprobs length", _seg(1, lambda s: s.logprobs.append(0.0)), "segment.logprobs"),
    ("loss_mask length", _seg(0, lambda s: s.__setattr__("loss_mask", b"\x01")),
     "segment.loss_mask"),
    ("loss_mask value", _seg(0, lambda s: s.__setattr__("loss_mask", b"\x01\x01\x07\x01")),
     "segment.loss_mask"),
    ("tokens over limit", _seg(1, lambda s: (s.token_ids.extend([1] * 60),
                                             s.logprobs.extend([0.0] * 60),
                                             s.__setattr__("loss_mask", b"\x01" * 63))),
     "segment.token_ids"),
    ("routing missing", _seg(1, lambda s: s.ClearField("routing")), "segment.routing"),
    ("rows P+R (off by one)", _seg(0, lambda s: s.routing[1].CopyFrom(_chunk(4, 8))),
     "segment.routing: 12 rows, expected 11"),
    ("start_row gap", _seg(1, lambda s: s.routing[0].CopyFrom(_chunk(3, 12))),
     r"segment.routing[0].start_row"),
    ("checksum", _seg(0, lambda s: s.routing[1].__setattr__("checksum", 1)),
     "segment.routing[1].checksum"),
    ("codec", _seg(0, lambda s: s.routing[0].__setattr__("codec", 0)),
     "segment.routing[0].codec"),
    ("shape vs data", _seg(1, lambda s: s.routing[0].shape.__setitem__(2, 1)),
     "segment.routing[0].shape"),
    ("num_experts vs data", _seg(1, lambda s: s.routing[0].__setattr__("num_experts", 9)),
     "segment.routing[0].num_experts"),
    ("layer_ids count", _seg(1, lambda s: s.routing[0].layer_ids.append(9)),
     "segment.routing[0].layer_ids"),
    ("ids >= num_experts", _seg(1, _ids_beyond_experts), "segment.routing[0].data"),
    ("corrupt data", _seg(1, lambda s: (s.routing[0].__setattr__("data", b"\xff" * 12),
                                        _recrc(s.routing[0]))), "segment.routing[0]."),
    ("layers change", _seg(1, lambda s: s.routing[0].CopyFrom(_chunk(3, 11, layers=3))),
     "segment.routing[0].shape[1]"),
    ("topk change", _seg(1, lambda s: s.routing[0].CopyFrom(_chunk(3, 11, topk=3))),
     "segment.routing[0].shape[2]"),
    ("num_experts change", _seg(1, lambda s: s.routing[0].CopyFrom(_chunk(3, 11, experts=16))),
     "segment.routing[0].num_experts"),
    ("layer_ids change", _seg(1, lambda s: s.routing[0].CopyFrom(_chunk(3, 11,
                                                                        layer_ids=[3, 4]))),
     "segment.routing[0].layer_ids"),
    ("num_segments", lambda r: [r[3].finish.__setattr__("num_segments", 1), r][1],
     "finish.num_segments"),
    ("reward NaN", lambda r: [r[3].finish.__setattr__("reward", float("nan")), r][1],
     "finish.reward"),
]


@pytest.mark.parametrize("name, mutate, field", CASES, ids=[c[0] for c in CASES])
def test_malformed_append_rejected_and_leaves_no_keys(
        strict_store: StoreProcess, name: str, mutate, field: str) -> None:  # noqa: ANN001
    before = redis_keys(strict_store.redis_url, PREFIX)
    with StoreClient(strict_store.address, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.append(mutate(_reqs()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()
    assert redis_keys(strict_store.redis_url, PREFIX) == before


def test_oversized_message_is_resource_exhausted_and_leaves_no_keys(
        strict_store: StoreProcess) -> None:
    before = redis_keys(strict_store.redis_url, PREFIX)
    reqs = _reqs()
    reqs[1].segment.routing[0].layer_ids.extend([0] * 20000)  # > max_message_bytes=16384
    with StoreClient(strict_store.address, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.append(reqs)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("AppendRequest: "), err.value.details()
    assert "max_message_bytes=16384" in err.value.details()
    assert redis_keys(strict_store.redis_url, PREFIX) == before


def test_valid_stream_after_rejections_is_accepted(strict_store: StoreProcess) -> None:
    with StoreClient(strict_store.address) as client:
        assert client.append(_reqs()).accepted == 4
