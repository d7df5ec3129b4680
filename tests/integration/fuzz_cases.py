"""Malformed TrajectoryStore requests for tests/integration/test_store_fuzz.py.

`make_case(rng, bases)` returns one `Case`: a method, its raw request bytes (a list for the
Append stream) and a kind. Structured kinds are invalid by construction; raw byte mutations may
happen to stay valid, so their streams end with SENTINEL (a request with no body): the store
validates a whole stream before writing any of it, so a mutant that validates is still refused
(by the sentinel, which the test counts) and nothing of it reaches Redis.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.pb.r3flow.v1 import routing_pb2, store_pb2
from services.common.wire import routing_to_proto
from services.store.parts import trajectory_requests
from services.store.synthetic import random_routing, small_group

SENTINEL_ID = "zz-sentinel"
SENTINEL = store_pb2.AppendRequest(trajectory_id=SENTINEL_ID, sequence_number=0)
MAX_MESSAGE = 16384  # the fuzzed store's max_message_bytes
TRANSPORT_CAP = 4 * MAX_MESSAGE + (1 << 20)  # services/store/server.py transport_cap
PUBLISHED_PLAN = 1000  # the test publishes this weight-sync version before fuzzing
Reqs = list[store_pb2.AppendRequest]


@dataclass
class Case:
    kind: str
    method: str
    payload: list[bytes] | bytes
    sentinel: bool = False
    expect_ok: bool = False  # well-formed ack of an unknown delivery id: acked=0 by design
    extra: dict = field(default_factory=dict)


def base_streams(n: int) -> list[Reqs]:
    """n valid streams: begin, segment 0 (prompt chunk + rows [8,11)), segment 1, finish."""
    return [trajectory_requests(small_group(f"fz-{i}", 2, seed=i)[0]) for i in range(n)]


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
        table.append(c)
    return table


_CRC = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return ~crc & 0xFFFFFFFF


def _reseal(chunk: routing_pb2.RoutedExperts, inner: bool) -> None:
    """Recompute the blob's CRC-32C (`inner`) and the proto CRC-32 so damage reaches parsers."""
    data = bytearray(chunk.data)
    if inner and len(data) >= 32:
        struct.pack_into("<I", data, 28, crc32c(bytes(data[:28] + data[32:])))
    chunk.data = bytes(data)
    chunk.checksum = zlib.crc32(chunk.data)


def _chunk(r: Reqs, rng: np.random.Generator) -> routing_pb2.RoutedExperts:
    j = int(rng.integers(2))
    seg = r[1 + j].segment
    return seg.routing[int(rng.integers(len(seg.routing)))]


def _other(rng: np.random.Generator, current: int, hi: int) -> int:
    v = int(rng.integers(0, hi))
    return v if v != current else current + 1


def m_shape(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    d = int(rng.integers(3))
    c.shape[d] = _other(rng, c.shape[d], [1 << 20, 300, 40][d])


def m_num_experts(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    c.num_experts = _other(rng, c.num_experts, 70_000)


def m_ids_beyond_experts(r: Reqs, rng: np.random.Generator) -> None:
    """A well-formed blob whose ids reach 15 while its header (CRC-32C fixed) says 8 experts."""
    seg = r[2].segment
    ids = random_routing(3, 2, 2, 16, rng)
    ids[int(rng.integers(3)), int(rng.integers(2))] = [14, 15]
    blob = bytearray(routing_to_proto(ids, 16, start_row=11, layer_ids=[0, 1]).data)
    struct.pack_into("<H", blob, 8, 8)
    seg.routing[0].data = bytes(blob)
    _reseal(seg.routing[0], inner=True)


def m_truncate_codec(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    c.data = c.data[: int(rng.integers(len(c.data)))]
    if rng.random() < 0.5:
        _reseal(c, inner=False)


def m_corrupt_codec(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    data = bytearray(c.data)
    for _ in range(int(rng.integers(1, 4))):
        i = int(rng.integers(len(data)))
        data[i] ^= 1 << int(rng.integers(8))
    c.data = bytes(data)
    if rng.random() < 0.5:
        _reseal(c, inner=False)  # past the proto CRC-32; the blob's CRC-32C still catches it


def m_start_row(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    c.start_row = _other(rng, c.start_row, 1 << 40)


def m_layer_ids(r: Reqs, rng: np.random.Generator) -> None:
    c = _chunk(r, rng)
    if rng.random() < 0.5 or not c.layer_ids:
        c.layer_ids.extend(int(x) for x in rng.integers(0, 1 << 31, int(rng.integers(1, 5))))
    else:
        del c.layer_ids[-1]


def m_codec_enum(r: Reqs, rng: np.random.Generator) -> None:
    _chunk(r, rng).codec = int(rng.choice([0, 2, 3, 7, 1 << 20]))


def m_lengths(r: Reqs, rng: np.random.Generator) -> None:
    seg = r[1 + int(rng.integers(2))].segment
    k = int(rng.integers(5))
    if k == 0:
        seg.logprobs.append(float(rng.normal()))
    elif k == 1:
        del seg.logprobs[-1]
    elif k == 2:
        seg.loss_mask = seg.loss_mask + b"\x01"
    elif k == 3:
        seg.loss_mask = bytes([2 + int(rng.integers(250))]) + seg.loss_mask[1:]
    else:
        seg.logprobs[0] = float("nan")


def m_tokens_over_limit(r: Reqs, rng: np.random.Generator) -> None:
    seg = r[2].segment
    n = int(rng.integers(60, 400))
    seg.token_ids.extend([1] * n)
    seg.logprobs.extend([0.0] * n)
    seg.loss_mask = seg.loss_mask + b"\x01" * n


def m_sequence(r: Reqs, rng: np.random.Generator) -> None:
    k = int(rng.integers(4))
    if k == 0:
        i = int(rng.integers(4))
        r[i].sequence_number = _other(rng, r[i].sequence_number, 1 << 32)
    elif k == 1:
        del r[0]  # no begin
    elif k == 2:
        r[1], r[2] = r[2], r[1]
    else:
        del r[int(rng.integers(1, 3))]  # a gap


def m_begin(r: Reqs, rng: np.random.Generator) -> None:
    b = r[0].begin
    k = int(rng.integers(4))
    if k == 0:
        b.group_size = int(rng.choice([0, 1025, 1 << 31]))
    elif k == 1:
        b.ClearField("prompt_token_ids")
    elif k == 2:
        b.prompt_token_ids.extend([1] * int(rng.integers(60, 200)))
    else:
        b.group_id = ""


def m_finish(r: Reqs, rng: np.random.Generator) -> None:
    f = r[3].finish
    if rng.random() < 0.5:
        f.num_segments = _other(rng, f.num_segments, 100)
    else:
        f.reward = float(rng.choice([np.nan, np.inf, -np.inf]))


def m_envelope(r: Reqs, rng: np.random.Generator) -> None:
    i = int(rng.integers(4))
    if rng.random() < 0.5:
        r[i].trajectory_id = ""
    else:
        r[i].ClearField(r[i].WhichOneof("body"))


STRUCTURED: dict[str, Callable[[Reqs, np.random.Generator], None]] = {
    f.__name__[2:]: f for f in (m_shape, m_num_experts, m_ids_beyond_experts, m_truncate_codec,
                                m_corrupt_codec, m_start_row, m_layer_ids, m_codec_enum,
                                m_lengths, m_tokens_over_limit, m_sequence, m_begin, m_finish,
                                m_envelope)}


def _copy(reqs: Reqs) -> Reqs:
    return [store_pb2.AppendRequest.FromString(q.SerializeToString()) for q in reqs]


def _mutate_bytes(data: bytes, rng: np.random.Generator) -> bytes:
    buf = bytearray(data)
    k = int(rng.integers(4))
    if k == 0 and buf:
        for _ in range(int(rng.integers(1, 6))):
            buf[int(rng.integers(len(buf)))] ^= 1 << int(rng.integers(8))
    elif k == 1 and buf:
        del buf[int(rng.integers(len(buf))):]
    elif k == 2:
        i = int(rng.integers(len(buf) + 1))
        buf[i:i] = rng.bytes(int(rng.integers(1, 16)))
    elif buf:
        i = int(rng.integers(len(buf)))
        del buf[i:i + int(rng.integers(1, 16))]
    return bytes(buf)


def raw_append(rng: np.random.Generator, bases: list[Reqs]) -> Case:
    """Random bytes or byte-mutated serialized requests, then the sentinel."""
    if rng.random() < 0.3:
        msgs = [rng.bytes(int(rng.integers(0, 400))) for _ in range(int(rng.integers(1, 4)))]
        kind = "bytes_random"
    else:
        msgs = [q.SerializeToString() for q in bases[int(rng.integers(len(bases)))]]
        i = int(rng.integers(len(msgs)))
        msgs[i] = _mutate_bytes(msgs[i], rng)
        kind = "bytes_mutated"
    return Case(kind, "Append", [*msgs, SENTINEL.SerializeToString()], sentinel=True)


def oversize_append(rng: np.random.Generator, bases: list[Reqs], size: int | None = None
                    ) -> Case:
    """Segment 0 over max_message_bytes (by default still under gRPC's transport cap: messages
    over that cap are test_store_fuzz.py's separate known-bug case)."""
    r = _copy(bases[int(rng.integers(len(bases)))])
    size = size or int(rng.integers(MAX_MESSAGE + 1, 4 * MAX_MESSAGE))
    r[1].segment.routing[0].layer_ids.extend([0] * size)  # packed zeros: one byte each
    return Case("oversize", "Append", [q.SerializeToString() for q in r])


def _unparseable(rng: np.random.Generator) -> bytes:
    # Wire type 7 does not exist: the first tag already makes the bytes unparseable.
    return bytes([0x0F]) + rng.bytes(int(rng.integers(0, 64)))


def unary_case(rng: np.random.Generator) -> Case:
    k = int(rng.integers(7))
    if k == 0:
        return Case("unparseable", str(rng.choice(["Pull", "Ack", "PublishPolicyVersion",
                                                   "RegisterWorker", "PublishWeightSync",
                                                   "Append", "AppendBatch"])),
                    _unparseable(rng))
    if k == 1:
        req = store_pb2.PullRequest(consumer="" if rng.random() < 0.5 else "c", max_groups=0
                                    if rng.random() < 0.5 else int(rng.integers(0, 1 << 31)),
                                    lease_seconds=int(rng.integers(0, 1 << 31)))
        if req.consumer and req.max_groups:
            req.consumer = ""
        return Case("pull_args", "Pull", req.SerializeToString())
    if k == 2:
        ids = [rng.bytes(int(rng.integers(0, 24))).decode("latin-1") for _ in range(3)]
        ids.append("99999999999999999999999-0")
        return Case("ack_malformed_id", "Ack", store_pb2.AckRequest(
            consumer="c" if rng.random() < 0.8 else "", delivery_ids=ids).SerializeToString())
    if k == 3:
        ids = [f"{int(rng.integers(1, 1 << 50))}-{int(rng.integers(0, 99))}" for _ in range(3)]
        return Case("ack_unknown_id", "Ack", store_pb2.AckRequest(
            consumer="c", delivery_ids=ids).SerializeToString(), expect_ok=True)
    if k == 4:
        v = -int(rng.integers(1, 1 << 62))
        return Case("policy_version", "PublishPolicyVersion",
                    store_pb2.PolicyVersion(version=v).SerializeToString())
    if k == 5:
        info = store_pb2.WorkerInfo(worker_id="" if rng.random() < 0.5 else "w", host="h",
                                    world_size=0)
        if not info.worker_id or rng.random() < 0.5:
            info.world_size = int(rng.integers(0, 9))
            info.worker_id = ""
        return Case("register_worker", "RegisterWorker", info.SerializeToString())
    plan = store_pb2.WeightSyncPlan(version=int(rng.integers(-(1 << 40), PUBLISHED_PLAN)),
                                    master_addr=rng.bytes(8).hex(), backend="gloo")
    return Case("weight_sync_stale", "PublishWeightSync", plan.SerializeToString())


def make_case(rng: np.random.Generator, bases: list[Reqs]) -> Case:
    """One malformed request: 55% structured Append, 25% raw bytes, 5% oversize, 15% unary."""
    u = rng.random()
    if u < 0.55:
        name = str(rng.choice(list(STRUCTURED)))
        r = _copy(bases[int(rng.integers(len(bases)))])
        STRUCTURED[name](r, rng)
        return Case(name, "Append", [q.SerializeToString() for q in r])
    if u < 0.80:
        return raw_append(rng, bases)
    if u < 0.85:
        return oversize_append(rng, bases)
    return unary_case(rng)
