"""A group's encoded routing on disk while its other samples run (issue 54).

The worker encodes each trajectory's routing as soon as it ends, but the store takes only
complete groups, so the encoded chunks of every finished trajectory wait for the last one. Once
a group's encoded routing passes `spill_routing_bytes` (0: always), each finished trajectory's
chunks go to one spill file per group (in `spill_routing_dir`, default the system temp dir) and
leave memory; the sink reads them back one trajectory at a time as it sends the group
(StoreSink: one trajectory after another, long segments in parts), so the worker holds about
one trajectory's routing instead of the group's. The same bytes reach the store: a segment's
chunks are written as a Segment holding only them and appended back in order. The file is
removed when the group is sent, failed or cancelled (`close`).
"""

from __future__ import annotations

import os
import tempfile
from typing import IO

from services.common.pb.r3flow.v1 import trajectory_pb2

KNOB = "rollout spill_routing_dir / spill_routing_bytes"


class RoutingSpill:
    """The spill of one group: `keep` each finished trajectory, `restore` / `release` each
    around its send, `close` once the group is sent or dropped."""

    def __init__(self, threshold_bytes: int, directory: str | None = None) -> None:
        self.threshold_bytes = threshold_bytes
        self.directory = directory
        self._held: list[trajectory_pb2.Trajectory] = []  # finished, routing still in memory
        self._held_bytes = 0
        self._spans: dict[str, list[tuple[int, int]]] = {}  # trajectory_id -> per segment
        self._file: IO[bytes] | None = None
        self.spilled_bytes = 0

    def keep(self, traj: trajectory_pb2.Trajectory) -> None:
        """A finished trajectory: to disk (with those held so far) once the group's routing
        passes the threshold. A write failure raises ValueError naming the knob."""
        self._held.append(traj)
        self._held_bytes += sum(c.ByteSize() for s in traj.segments for c in s.routing)
        if self._file is None and self._held_bytes <= self.threshold_bytes and \
                self.threshold_bytes > 0:
            return
        try:
            for t in self._held:
                self._write(t)
        except OSError as e:
            raise ValueError(f"{KNOB}: cannot write the routing spill file in "
                             f"{self.directory or tempfile.gettempdir()}: {e}") from None
        self._held.clear()
        self._held_bytes = 0

    def _write(self, traj: trajectory_pb2.Trajectory) -> None:
        if self._file is None:
            self._file = tempfile.NamedTemporaryFile(prefix="r3flow-routing-",
                                                     dir=self.directory)
        f = self._file
        spans = []
        for seg in traj.segments:
            data = trajectory_pb2.Segment(routing=seg.routing).SerializeToString()
            spans.append((f.tell(), len(data)))
            f.write(data)
            self.spilled_bytes += len(data)
            del seg.routing[:]
        self._spans[traj.trajectory_id] = spans

    def spilled(self) -> bool:
        return self._file is not None

    def restore(self, traj: trajectory_pb2.Trajectory) -> None:
        """Put a spilled trajectory's routing chunks back (in their order)."""
        spans = self._spans.get(traj.trajectory_id)
        if spans is None or self._file is None:
            return
        self._file.flush()
        for seg, (offset, length) in zip(traj.segments, spans, strict=True):
            data = os.pread(self._file.fileno(), length, offset)
            seg.routing.extend(trajectory_pb2.Segment.FromString(data).routing)

    def release(self, traj: trajectory_pb2.Trajectory) -> None:
        """Drop a spilled trajectory's routing from memory again (it stays in the file)."""
        if traj.trajectory_id in self._spans:
            for seg in traj.segments:
                del seg.routing[:]

    def close(self) -> None:
        """Remove the file (a NamedTemporaryFile: deleted when closed)."""
        if self._file is not None:
            self._file.close()
            self._file = None
        self._held.clear()
