"""Rebuild full per-trajectory `Trajectory` messages of a ready group from Redis.

Segment 0's prompt routing chunk is kept once per group (group hash field `p:<sha1>`); here it
is put back as the first chunk of segment 0, so trainers see exactly what the worker sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.common.pb.r3flow.v1 import routing_pb2, store_pb2, trajectory_pb2
from services.store.keys import Keys


@dataclass
class Delivery:
    """One leased group: `delivery_id` (stream entry id) is what the trainer acks."""

    delivery_id: str
    group_id: str
    delivery_count: int
    min_policy_version: int
    trajectories: list[trajectory_pb2.Trajectory] = field(default_factory=list)

    def to_proto(self) -> store_pb2.PulledGroup:
        return store_pb2.PulledGroup(delivery_id=self.delivery_id, group_id=self.group_id,
                                     trajectories=self.trajectories,
                                     delivery_count=self.delivery_count)


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
        traj = rebuild_trajectory(h, group)
        if traj.finish_reason != trajectory_pb2.FINISH_REASON_ABORTED:
            d.trajectories.append(traj)
    return d


def rebuild_trajectory(h: dict[bytes, bytes], group: dict[bytes, bytes]
                       ) -> trajectory_pb2.Trajectory:
    """Header + segments (+ shared prompt chunk) + finish fields -> one Trajectory."""
    traj = trajectory_pb2.Trajectory.FromString(h[b"h"])
    for j in range(int(h[b"nseg"])):
        traj.segments.add().MergeFromString(h[f"s:{j}".encode()])
    pkey = h.get(b"pkey")
    if pkey:
        seg0 = traj.segments[0]
        rest = list(seg0.routing)
        del seg0.routing[:]
        seg0.routing.append(routing_pb2.RoutedExperts.FromString(group[pkey]))
        seg0.routing.extend(rest)
    fin = store_pb2.TrajectoryFinish.FromString(h[b"f"])
    traj.reward = fin.reward
    traj.reward_components.update(fin.reward_components)
    traj.finish_reason = fin.finish_reason
    return traj
