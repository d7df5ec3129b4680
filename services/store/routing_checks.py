"""Checks of one routing chunk (`RoutedExperts`) of an append, and the payload walks that one
Append stream defers so they run together, off the GIL (`RoutingChecks`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from services.common import routing, routing_rules
from services.common.pb.r3flow.v1 import routing_pb2, store_pb2


def in_context(message: object, req: store_pb2.AppendRequest) -> ValueError:
    """An error of one message, naming it: '<field>: <what> [trajectory_id=.. sequence_number=..]'."""
    return ValueError(f"{message} [trajectory_id={req.trajectory_id!r} "
                      f"sequence_number={req.sequence_number}]")


@dataclass
class RoutingChecks:
    """Routing payloads of one Append stream still to be walked (`routing.check_many`).

    The stream's other checks run first, message by message; the payloads are then walked in
    one GIL-free call on `threads` threads. `raise_first` keeps the error a message-by-message
    check would report: the first failing payload in stream order, if any comes before (or in
    the same chunk as) the error the other checks found.
    """

    threads: int = 1
    items: list[tuple[bytes, str, store_pb2.AppendRequest]] = field(default_factory=list)
    # Below this many payload bytes a second thread costs more than it saves (a rollout's
    # trajectory of a few hundred tokens: its start and join on a busy machine; issue 34).
    thread_min_bytes: int = 256 << 10

    def add(self, data: bytes, name: str, req: store_pb2.AppendRequest) -> None:
        self.items.append((data, name, req))

    def raise_first(self) -> None:
        """Walk every pending payload; raise the first failure (with its message's context)."""
        items, self.items = self.items, []
        blobs = [data for data, _, _ in items]
        threads = self.threads if sum(map(len, blobs)) >= self.thread_min_bytes else 1
        results = routing.check_many(blobs, threads)
        for (_, name, req), result in zip(items, results, strict=True):
            if isinstance(result, ValueError):
                raise in_context(f"{name}.data: {result}", req)


@dataclass
class Walk:
    """How a chunk's payload is walked: not at all (routing_validation="header"), now, or
    later as part of the stream's `RoutingChecks`."""

    decode: bool
    pending: RoutingChecks | None
    req: store_pb2.AppendRequest
    models: tuple[tuple[str, int, int], ...] = ()  # registered (name, num_experts, top_k)


def check_chunk(chunk: routing_pb2.RoutedExperts, name: str, walk: Walk) -> tuple[int, int]:
    """(rows, ids) of a chunk after every check of `routing_from_proto`, in its order and with
    its messages, without building the ids array: `routing.check` walks the payload as decode
    does (ids < num_experts, distinct per row), here or via `walk.pending`."""
    if chunk.codec != routing_pb2.ROUTING_CODEC_R3C:
        raise ValueError(f"{name}.codec: unsupported codec {chunk.codec}")
    if len(chunk.shape) != 3:
        raise ValueError(f"{name}.shape: expected [rows, layers, topk], got {list(chunk.shape)}")
    data = chunk.data
    if zlib.crc32(data) != chunk.checksum:
        raise ValueError(f"{name}.checksum: CRC-32 of data does not match")
    if len(chunk.layer_ids) != chunk.shape[1]:
        raise ValueError(f"{name}.layer_ids: {len(chunk.layer_ids)} entries for "
                         f"{chunk.shape[1]} layers")
    try:
        hdr = routing.check(data) if walk.decode and walk.pending is None \
            else routing.peek_header(data)
    except ValueError as e:
        raise ValueError(f"{name}.data: {e}") from None
    if walk.decode and walk.pending is not None:
        walk.pending.add(data, name, walk.req)  # length and payload: before the checks below
    # The chunk's fields are the spec its data must meet (routing_rules: rows, layers, top-k,
    # num_experts, in that order).
    declared = routing_rules.RoutingSpec(chunk.num_experts, top_k=chunk.shape[2],
                                         rows=chunk.shape[0], layers=chunk.shape[1])
    try:
        routing_rules.check_rows(hdr.tokens, declared)
        routing_rules.check_layout(declared, layers=hdr.layers, top_k=hdr.topk,
                                   num_experts=hdr.num_experts)
    except routing_rules.RoutingRuleError as e:
        if e.field == "num_experts":
            raise ValueError(f"{name}.num_experts: says {chunk.num_experts}, data holds "
                             f"{hdr.num_experts}") from None
        raise ValueError(f"{name}.shape: says {list(chunk.shape)}, data holds "
                         f"{list(hdr.shape)}") from None
    return hdr.tokens, hdr.tokens * hdr.layers * hdr.topk
