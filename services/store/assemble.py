"""Rebuild full per-trajectory `Trajectory` messages of a ready group from Redis.

Segment 0's prompt routing chunk is kept once per group (group hash field `p:<sha256>`); here it
is spliced back as the first chunk of segment 0, so trainers see exactly what the worker sent.
Payloads are spliced as wire bytes (services/store/wirefmt.py), never parsed and re-serialized.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store import wirefmt
from services.store.keys import Keys


@dataclass
class Delivery:
    """One leased group: `delivery_id` (stream entry id) is what the trainer acks."""

    delivery_id: str
    group_id: str
    delivery_count: int
    min_policy_version: int
    trajectory_bytes: list[bytes] = field(default_factory=list)  # serialized Trajectory each
    run_ids: set[str] = field(default_factory=set)  # Trajectory.run_id of the members

    @property
    def trajectories(self) -> list[trajectory_pb2.Trajectory]:
        return [trajectory_pb2.Trajectory.FromString(b) for b in self.trajectory_bytes]

    def to_bytes(self) -> bytes:
        """The serialized PulledGroup (what the Pull stream sends)."""
        head = store_pb2.PulledGroup(delivery_id=self.delivery_id, group_id=self.group_id,
                                     delivery_count=self.delivery_count).SerializeToString()
        return head + b"".join(wirefmt.field(wirefmt.PULLED_TRAJECTORIES, t)
                               for t in self.trajectory_bytes)

    def to_proto(self) -> store_pb2.PulledGroup:
        return store_pb2.PulledGroup.FromString(self.to_bytes())


def assemble_group(r: Any, keys: Keys, gid: str, delivery_id: str,
                   delivery_count: int) -> Delivery | None:
    """The group's trainable trajectories (aborted ones left out); None if its keys are gone."""
    members = sorted(m.decode() for m in r.smembers(keys.group_members(gid)))
    with r.pipeline(transaction=False) as p:
        p.hgetall(keys.group(gid))
        for tid in members:
            p.hgetall(keys.traj(tid))
        group, *trajs = p.execute()
    if not group or not members:
        return None
    d = Delivery(delivery_id, gid, delivery_count, int(group.get(b"minpv", 0)))
    for h in trajs:
        if h.get(b"state") != b"complete":
            return None  # a released group is complete; anything else is lost data
        blob = trajectory_wire(h, group)
        if blob is not None:
            d.trajectory_bytes.append(blob)
            d.run_ids.add(trajectory_pb2.Trajectory.FromString(h[b"h"]).run_id)
    return d


def trajectory_wire(h: dict[bytes, bytes], group: dict[bytes, bytes]) -> bytes | None:
    """Header + segments (+ shared prompt chunk) + finish fields as one serialized Trajectory;
    None for an aborted trajectory (never trained on)."""
    fin = store_pb2.TrajectoryFinish.FromString(h[b"f"])
    if fin.finish_reason == trajectory_pb2.FINISH_REASON_ABORTED:
        return None
    parts = [h[b"h"]]
    pkey = h.get(b"pkey")
    for j in range(int(h[b"nseg"])):
        seg = h[f"s:{j}".encode()]
        if j == 0 and pkey:
            seg = wirefmt.join_prompt_segment(seg, group[pkey], int(h[b"hl"]))
        parts.append(wirefmt.field(wirefmt.TRAJECTORY_SEGMENTS, seg))
    finish = trajectory_pb2.Trajectory(reward=fin.reward, reward_components=fin.reward_components,
                                       finish_reason=fin.finish_reason)
    parts.append(finish.SerializeToString())
    return b"".join(parts)
