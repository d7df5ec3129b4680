"""Bounded staleness: the one `max_policy_lag` knob of the store, the rollout workers and the
trainer, and the one rule all three apply.

A run sets one value (the chart's `store.config.max_policy_lag`, which it copies into the
trainer's `data.max_policy_lag`; `r3flow local`'s `store.max_policy_lag`, which it copies into
both): the store drops at delivery, the trainer at intake, and a rollout worker holds a new
group, whatever is more than that many policy versions behind.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

# None: no bound (a component does not guess a run's tolerance; the run's config sets one).
DEFAULT_MAX_POLICY_LAG: int | None = None

MaxPolicyLag = Annotated[int | None, Field(ge=0)]


def too_stale(current_version: int, oldest_version: int, max_policy_lag: int | None) -> bool:
    """Whether weights `oldest_version` lag `current_version` by more than `max_policy_lag`
    versions (never with no bound)."""
    return max_policy_lag is not None and current_version - oldest_version > max_policy_lag
