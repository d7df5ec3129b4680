"""A trajectory as Append messages, long segments in parts (the append side); PulledGroup
messages rebuilt from a PullChunks stream of PulledPart messages (the pull side).

The store sends each delivered group as a head, then every trajectory's head, its segments'
heads and their routing chunks in order (store.proto, PulledPart); each head counts what follows
it directly, so a group is whole exactly when every count is met. The receiver holds the groups
it rebuilds (the batch, routing still encoded) and one part at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2


def trajectory_requests(traj: trajectory_pb2.Trajectory, part_bytes: int | None = None
                        ) -> list[store_pb2.AppendRequest]:
    """Split a complete Trajectory into begin (0), segments (1..n) and finish (n+1); with
    `part_bytes`, a segment larger than that goes in parts of about that size (`segment_parts`)."""
    return list(iter_trajectory_requests(traj, part_bytes))


def iter_trajectory_requests(traj: trajectory_pb2.Trajectory, part_bytes: int | None = None
                             ) -> Iterator[store_pb2.AppendRequest]:
    """`trajectory_requests` one segment's messages at a time (append_in_parts: the caller
    never holds a second copy of the whole trajectory's routing)."""
    tid = traj.trajectory_id
    begin = store_pb2.TrajectoryBegin(
        group_id=traj.group_id, group_size=traj.group_size,
        prompt_token_ids=traj.prompt_token_ids, worker_id=traj.worker_id,
        prompt_id=traj.prompt_id, epoch=traj.epoch, run_id=traj.run_id)
    yield store_pb2.AppendRequest(trajectory_id=tid, sequence_number=0, begin=begin)
    for j, seg in enumerate(traj.segments):
        yield from segment_parts(tid, j + 1, seg, part_bytes)
    yield store_pb2.AppendRequest(
        trajectory_id=tid, sequence_number=len(traj.segments) + 1,
        finish=store_pb2.TrajectoryFinish(
            num_segments=len(traj.segments), reward=traj.reward,
            reward_components=traj.reward_components, finish_reason=traj.finish_reason))


def segment_parts(tid: str, seq: int, seg: trajectory_pb2.Segment, part_bytes: int | None
                  ) -> list[store_pb2.AppendRequest]:
    """A segment as one AppendRequest, or, when larger than `part_bytes`, as parts: part 0 its
    tokens and first routing chunks, later parts further chunks, each part up to `part_bytes`
    of chunks (at least one chunk each; store.proto AppendRequest.part)."""
    if part_bytes is None or seg.ByteSize() <= part_bytes:
        return [store_pb2.AppendRequest(trajectory_id=tid, sequence_number=seq, segment=seg)]
    parts = [trajectory_pb2.Segment(index=seg.index, token_ids=seg.token_ids,
                                    logprobs=seg.logprobs, loss_mask=seg.loss_mask,
                                    policy_version=seg.policy_version)]
    if seg.HasField("sampling"):
        parts[0].sampling.CopyFrom(seg.sampling)
    size = 0
    for chunk in seg.routing:
        if parts[-1].routing and size + chunk.ByteSize() > part_bytes:
            parts.append(trajectory_pb2.Segment(index=seg.index))
            size = 0
        parts[-1].routing.append(chunk)
        size += chunk.ByteSize()
    return [store_pb2.AppendRequest(trajectory_id=tid, sequence_number=seq, segment=p, part=k,
                                    more_parts=k + 1 < len(parts))
            for k, p in enumerate(parts)]


class GroupAssembler:
    """Feed parts in stream order with `add`; `groups` are the whole groups so far."""

    def __init__(self) -> None:
        self.groups: list[store_pb2.PulledGroup] = []
        self._group: store_pb2.PulledGroup | None = None
        self._traj: trajectory_pb2.Trajectory | None = None
        self._seg: trajectory_pb2.Segment | None = None
        self._left = [0, 0, 0]  # trajectories of the group, segments of the trajectory, chunks

    @property
    def cut_short(self) -> bool:
        """A group was begun and is not whole (the stream broke off inside it)."""
        return self._group is not None

    def add(self, part: store_pb2.PulledPart) -> None:
        kind = part.WhichOneof("body")
        if kind == "group":
            if self._group is not None:
                raise ValueError(f"PulledPart: group {part.group.group_id!r} began before group "
                                 f"{self._group.group_id!r} was whole")
            self._group, self._left = store_pb2.PulledGroup(), [part.parts, 0, 0]
            self._group.CopyFrom(part.group)
        elif kind == "trajectory":
            self._take(0, "trajectory")
            self._traj = self._group.trajectories.add()  # type: ignore[union-attr]
            self._traj.CopyFrom(part.trajectory)
            self._left[1] = part.parts
        elif kind == "segment":
            self._take(1, "segment")
            self._seg = self._traj.segments.add()  # type: ignore[union-attr]
            self._seg.CopyFrom(part.segment)
            self._left[2] = part.parts
        elif kind == "routing":
            self._take(2, "routing")
            self._seg.routing.add().CopyFrom(part.routing)  # type: ignore[union-attr]
        else:
            raise ValueError("PulledPart: body missing (group, trajectory, segment or routing)")
        if self._group is not None and not any(self._left):
            self.groups.append(self._group)
            self._group = self._traj = self._seg = None

    def _take(self, level: int, kind: str) -> None:
        """Count a part at `level` (0 trajectory, 1 segment, 2 chunk) against its head."""
        if self._group is None or self._left[level] == 0 or any(self._left[level + 1:]):
            raise ValueError(f"PulledPart: a {kind} part where none is due (the stream's parts "
                             "are out of order)")
        self._left[level] -= 1
