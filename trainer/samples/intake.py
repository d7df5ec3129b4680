"""Pulled GRPO groups -> training samples, trajectory by trajectory; bad groups quarantined.

A group whose routing or sampling fails a check (`quarantine_reason`) is set aside with a
reason instead of failing the step: the trainer acks it to the store as dropped, so a restarted
trainer never pulls it again (no crash loop). Every trajectory is mapped with ITS OWN engine layer ids (rollout workers of one run may report
layers differently, e.g. after an engine upgrade): one trajectory's `layer_ids` never stand in
for another's. Aborted trajectories are skipped; r3 needs routing on every trajectory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from trainer.replay import ReplayMode
from trainer.samples.alignment import InvalidRoutingError, LayerMap, RoutingLayoutError
from trainer.samples.batch import Sample, UnreproducibleSamplingError, sample_from_trajectory

log = logging.getLogger(__name__)


def trajectory_layer_ids(traj: Any) -> tuple[int, ...] | None:
    """Engine layer ids of a trajectory's routing (its chunks must all agree), or None."""
    found = {tuple(int(x) for x in c.layer_ids) for s in traj.segments for c in s.routing}
    if len(found) > 1:
        raise ValueError(f"trajectory {traj.trajectory_id}: layer_ids differ between its routing "
                         f"chunks: {sorted(found)}")
    return found.pop() if found else None


def group_samples(group: Any, mode: ReplayMode, layer_map: Callable[[Sequence[int]], LayerMap],
                  num_experts: int, top_k: int, keep_encoded: bool = True) -> list[Sample]:
    """Samples of one pulled group (aborted trajectories left out); ValueError on bad routing.
    The routing is checked here and kept encoded, each micro-batch decoding its own
    (`keep_encoded`; False: decoded here, as before issue 54, the bench's baseline)."""
    from services.common.pb.r3flow.v1 import trajectory_pb2

    samples = []
    for t in group.trajectories:
        if t.finish_reason == trajectory_pb2.FINISH_REASON_ABORTED:
            log.warning("skipping aborted trajectory %s", t.trajectory_id)
            continue
        lmap = None
        if mode == ReplayMode.R3:
            layer_ids = trajectory_layer_ids(t)
            if layer_ids is None:
                raise ValueError(f"replay.mode: r3 but trajectory {t.trajectory_id} carries no "
                                 "routing")
            lmap = layer_map(layer_ids)
        samples.append(sample_from_trajectory(t, lmap, num_experts, top_k=top_k,
                                              keep_encoded=keep_encoded))
    return samples


def quarantine_reason(err: ValueError) -> str:
    """The bounded reason label of a group-level data error."""
    for cls, reason in ((RoutingLayoutError, "routing_layout"),
                        (InvalidRoutingError, "invalid_routing"),
                        (UnreproducibleSamplingError, "unreproducible_sampling")):
        if isinstance(err, cls):
            return reason
    return "bad_routing"  # layer map, row coverage, decode errors


def intake_groups(groups: Sequence[Any], mode: ReplayMode,
                  layer_map: Callable[[Sequence[int]], LayerMap], num_experts: int, top_k: int,
                  keep_encoded: bool = True) -> tuple[list[Sample], dict[str, str]]:
    """(samples of the good groups, group id -> reason of the quarantined ones)."""
    samples: list[Sample] = []
    dropped: dict[str, str] = {}
    for g in groups:
        try:
            samples += group_samples(g, mode, layer_map, num_experts, top_k, keep_encoded)
        except ValueError as e:
            dropped[g.group_id] = quarantine_reason(e)
            log.error("quarantining group %s (%s): %s", g.group_id, dropped[g.group_id], e)
    return samples, dropped
