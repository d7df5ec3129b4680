"""Rebuild PulledGroup messages from a PullChunks stream of PulledPart messages.

The store sends each delivered group as a head, then every trajectory's head, its segments'
heads and their routing chunks in order (store.proto, PulledPart); each head counts what follows
it directly, so a group is whole exactly when every count is met. The receiver holds the groups
it rebuilds (the batch, routing still encoded) and one part at a time.
"""

from __future__ import annotations

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2


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
