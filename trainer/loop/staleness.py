"""Staleness in policy versions: how far a pulled group lags the trainer's weights.

The trainer's version moves at every update (and is published to the store then); a segment
carries the version of the weights that sampled it, and a group is as old as its oldest segment.
"""

from __future__ import annotations

from typing import Any

from services.common.staleness import too_stale


def oldest_version(group: Any) -> int | None:
    """The smallest segment policy version over a pulled group's trajectories (None: none)."""
    return min((s.policy_version for t in group.trajectories for s in t.segments), default=None)


def staleness(group: Any, trainer_version: int) -> int:
    """Versions between the trainer's weights and the group's oldest segment (0: none)."""
    oldest = oldest_version(group)
    return 0 if oldest is None else trainer_version - oldest


def is_stale(group: Any, trainer_version: int, max_policy_lag: int | None) -> bool:
    """Whether the group's oldest segment lags the trainer by more than `max_policy_lag`."""
    oldest = oldest_version(group)
    return oldest is not None and too_stale(trainer_version, oldest, max_policy_lag)
