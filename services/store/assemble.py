"""Rebuild the trajectories of a ready group from Redis: whole, or as a stream of parts.

A stored segment is its head (`s:<j>`: tokens, logprobs, mask, version, sampling) and its
routing chunks, one Redis hash value each (`r:<j>:<c>`); segment 0's prompt chunk is kept once
per group (group hash field `p:<sha256>`) and spliced back as its first chunk, so trainers see
exactly what the worker sent. Segments stored before chunked storage (no `rc:<j>` field) are one
value holding the whole segment (minus the prompt chunk, which goes back at `hl`).

Reading a group fetches heads only; chunks are read from Redis one at a time as they are sent
(`Delivery.parts`), so the store never holds more than one chunk of a delivery streamed by
PullChunks. A whole PulledGroup (`Delivery.to_bytes`, the Pull RPC) still reads every chunk.
Payloads are spliced as wire bytes (services/store/wirefmt.py), never parsed and re-serialized.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store import wirefmt
from services.store.errors import ChunkMissing
from services.store.keys import Keys

# A routing chunk: its serialized bytes, or where they are in Redis (hash key, field, size).
Chunk = bytes | tuple[str, bytes, int]
# Chunks are read from Redis in batches of up to this many bytes (at least one chunk): one round
# trip per segment for short trajectories, a bounded buffer for long ones.
READ_BYTES = 4 << 20
_TRAJ_FIELDS = (b"state", b"h", b"f", b"nseg", b"pkey", b"hl")


@dataclass
class StoredSegment:
    head: bytes            # serialized Segment without routing
    chunks: list[Chunk]    # in row order


@dataclass
class Member:
    """One trajectory of a delivery: header and finish fields, its segments' heads and chunks."""

    trajectory_id: str
    header: bytes          # serialized Trajectory: header fields + finish fields, no segments
    segments: list[StoredSegment]

    @staticmethod
    def whole(blob: bytes) -> Member:
        """From one serialized Trajectory (chunks held as bytes)."""
        t = trajectory_pb2.Trajectory.FromString(blob)
        segs = [_split_segment(s) for s in t.segments]
        t.ClearField("segments")
        return Member(t.trajectory_id, t.SerializeToString(), segs)


@dataclass
class Delivery:
    """One leased group: `delivery_id` (stream entry id) is what the trainer acks. `source`
    is the Redis client chunks held as (key, field) are read from."""

    delivery_id: str
    group_id: str
    delivery_count: int
    min_policy_version: int
    members: list[Member | bytes] = field(default_factory=list)  # bytes: a whole Trajectory
    run_ids: set[str] = field(default_factory=set)  # Trajectory.run_id of the members
    source: Any = None

    def __post_init__(self) -> None:
        self.members = [Member.whole(m) if isinstance(m, bytes) else m for m in self.members]

    @property
    def trajectory_ids(self) -> list[str]:
        return [m.trajectory_id for m in self._members]

    @property
    def trajectories(self) -> list[trajectory_pb2.Trajectory]:
        return [trajectory_pb2.Trajectory.FromString(self._trajectory_wire(m))
                for m in self._members]

    @property
    def _members(self) -> list[Member]:
        return self.members  # type: ignore[return-value]  # bytes converted at init

    def _head(self) -> bytes:
        return store_pb2.PulledGroup(delivery_id=self.delivery_id, group_id=self.group_id,
                                     delivery_count=self.delivery_count).SerializeToString()

    def to_bytes(self) -> bytes:
        """The serialized PulledGroup (what the Pull stream sends): every chunk read."""
        return self._head() + b"".join(
            wirefmt.field(wirefmt.PULLED_TRAJECTORIES, self._trajectory_wire(m))
            for m in self._members)

    def to_proto(self) -> store_pb2.PulledGroup:
        return store_pb2.PulledGroup.FromString(self.to_bytes())

    def parts(self) -> Iterator[bytes]:
        """Serialized PulledPart messages (PullChunks): the group, then each trajectory, each
        of its segments and each routing chunk, reading one chunk at a time."""
        yield _part(wirefmt.PART_GROUP, self._head(), len(self.members))
        for m in self._members:
            yield _part(wirefmt.PART_TRAJECTORY, m.header, len(m.segments))
            for seg in m.segments:
                yield _part(wirefmt.PART_SEGMENT, seg.head, len(seg.chunks))
                for blob in self._read(seg.chunks):
                    yield _part(wirefmt.PART_ROUTING, blob, 0)

    def _read(self, chunks: list[Chunk]) -> Iterator[bytes]:
        """The chunks' bytes in order, read in batches of up to READ_BYTES per Redis key."""
        i = 0
        while i < len(chunks):
            c = chunks[i]
            if isinstance(c, bytes):
                yield c
                i += 1
                continue
            batch, size = [c], c[2]
            while i + len(batch) < len(chunks):
                nxt = chunks[i + len(batch)]
                if isinstance(nxt, bytes) or nxt[0] != c[0] or size + nxt[2] > READ_BYTES:
                    break
                batch.append(nxt)
                size += nxt[2]
            yield from self._fetch(batch)
            i += len(batch)

    def _fetch(self, batch: list[tuple[str, bytes, int]]) -> list[bytes]:
        blobs = self.source.hmget(batch[0][0], [f for _, f, _ in batch])
        for (key, name, _), blob in zip(batch, blobs, strict=True):
            if blob is None:
                raise ChunkMissing(f"group {self.group_id}: routing chunk {key} {name!r} is "
                                   "gone from Redis (the group was released while it was sent)")
        return blobs

    def _trajectory_wire(self, m: Member) -> bytes:
        segs = b"".join(wirefmt.field(wirefmt.TRAJECTORY_SEGMENTS, s.head + b"".join(
            wirefmt.field(wirefmt.SEGMENT_ROUTING, blob) for blob in self._read(s.chunks)))
            for s in m.segments)
        return m.header + segs


def _part(number: int, payload: bytes, count: int) -> bytes:
    tail = wirefmt.varint(wirefmt.PART_COUNT << 3) + wirefmt.varint(count) if count else b""
    return wirefmt.field(number, payload) + tail


def _split_segment(seg: trajectory_pb2.Segment) -> StoredSegment:
    chunks: list[Chunk] = [c.SerializeToString() for c in seg.routing]
    seg.ClearField("routing")
    return StoredSegment(seg.SerializeToString(), chunks)


def assemble_group(r: Any, keys: Keys, gid: str, delivery_id: str,
                   delivery_count: int) -> Delivery | None:
    """The group's trainable trajectories (aborted ones left out), chunks left in Redis; None
    if its keys are gone."""
    members = sorted(m.decode() for m in r.smembers(keys.group_members(gid)))
    with r.pipeline(transaction=False) as p:
        p.exists(keys.group(gid))
        p.hget(keys.group(gid), "minpv")
        for tid in members:
            p.hmget(keys.traj(tid), _TRAJ_FIELDS)
        exists, minpv, *states = p.execute()
    if not exists or not members:
        return None
    d = Delivery(delivery_id, gid, delivery_count, int(minpv or 0), source=r)
    kept: list[tuple[str, dict[bytes, Any]]] = []
    for tid, values in zip(members, states, strict=True):
        h = dict(zip(_TRAJ_FIELDS, values, strict=True))
        if h[b"state"] != b"complete":
            return None  # a released group is complete; anything else is lost data
        fin = store_pb2.TrajectoryFinish.FromString(h[b"f"])
        if fin.finish_reason != trajectory_pb2.FINISH_REASON_ABORTED:
            kept.append((tid, h))
    for (tid, h), segs in zip(kept, _segment_fields(r, keys, kept), strict=True):
        d.members.append(_member(r, keys, gid, tid, h, segs))
        d.run_ids.add(trajectory_pb2.Trajectory.FromString(h[b"h"]).run_id)
    _chunk_sizes(r, d.members)  # type: ignore[arg-type]
    return d


def _chunk_sizes(r: Any, members: list[Member]) -> None:
    """Fill in the size of every chunk held in Redis (HSTRLEN: one round trip), so reads can
    be batched by bytes."""
    refs = [(seg, i, c[0], c[1]) for m in members for seg in m.segments
            for i, c in enumerate(seg.chunks) if not isinstance(c, bytes)]
    with r.pipeline(transaction=False) as p:
        for _, _, key, name in refs:
            p.hstrlen(key, name)
        sizes = p.execute()
    for (seg, i, key, name), size in zip(refs, sizes, strict=True):
        seg.chunks[i] = (key, name, int(size))


def _segment_fields(r: Any, keys: Keys, kept: list[tuple[str, dict[bytes, Any]]]
                    ) -> list[list[tuple[bytes, int | None]]]:
    """(stored `s:<j>`, chunk count or None for a whole stored segment) of every segment."""
    with r.pipeline(transaction=False) as p:
        for tid, h in kept:
            n = int(h[b"nseg"])
            p.hmget(keys.traj(tid), [f"{k}:{j}" for j in range(n) for k in ("s", "rc")])
        replies = p.execute()
    return [[(vals[2 * j], None if vals[2 * j + 1] is None else int(vals[2 * j + 1]))
             for j in range(len(vals) // 2)] for vals in replies]


def _member(r: Any, keys: Keys, gid: str, tid: str, h: dict[bytes, Any],
            segs: list[tuple[bytes, int | None]]) -> Member:
    fin = store_pb2.TrajectoryFinish.FromString(h[b"f"])
    finish = trajectory_pb2.Trajectory(reward=fin.reward, reward_components=fin.reward_components,
                                       finish_reason=fin.finish_reason)
    pkey = h[b"pkey"]
    out = []
    for j, (stored, count) in enumerate(segs):
        if count is None:  # stored whole, before chunked storage
            if j == 0 and pkey:
                stored = wirefmt.join_prompt_segment(stored, r.hget(keys.group(gid), pkey),
                                                     int(h[b"hl"]))
            out.append(_split_segment(trajectory_pb2.Segment.FromString(stored)))
            continue
        chunks: list[Chunk] = [(keys.traj(tid), f"r:{j}:{c}".encode(), 0)
                               for c in range(count)]
        if j == 0 and pkey:
            chunks.insert(0, (keys.group(gid), pkey, 0))
        out.append(StoredSegment(stored, chunks))
    return Member(tid, h[b"h"] + finish.SerializeToString(), out)

