"""DAPO dynamic sampling at intake (Yu et al. 2025, arXiv 2503.14476, eq. 11): a pulled group
whose rewards are all equal has zero advantage on every sample, so no policy gradient; it is
acked to the store as dropped `equal_rewards` and the batch is refilled from the store.

A task the policy always (or never) solves would stall training, so a step inspects at most
`data.dynamic_sampling_max_pulls` x `groups_per_step` groups; past that, equal-reward groups
fill the batch (and are counted as kept).
"""

from __future__ import annotations

from typing import Any

from trainer.config import DataConfig
from trainer.losses.objectives import all_equal

REASON = "equal_rewards"


def group_rewards(group: Any) -> list[float]:
    """Rewards of a pulled group's trajectories."""
    return [float(t.reward) for t in group.trajectories]


def equal_reward_groups(groups: list) -> int:
    """How many of `groups` have all-equal rewards: zero advantage on every sample, so no
    policy gradient (a step of only such groups has a zero gradient, dynamic sampling or not)."""
    return sum(all_equal(group_rewards(g)) for g in groups)


class DynamicSampler:
    """Per-step counts of the groups inspected and dropped."""

    def __init__(self, cfg: DataConfig) -> None:
        self.cfg = cfg
        self.start_step()

    def start_step(self) -> None:
        self.inspected = self.dropped = 0

    def split(self, groups: list) -> tuple[list, list]:
        """(groups to train, equal-reward groups to drop)."""
        d = self.cfg
        if not d.dynamic_sampling:
            return groups, []
        keep: list = []
        drop: list = []
        for g in groups:
            self.inspected += 1
            budget_left = self.inspected <= d.dynamic_sampling_max_pulls * d.groups_per_step
            (drop if budget_left and all_equal(group_rewards(g)) else keep).append(g)
        self.dropped += len(drop)
        return keep, drop

    def metrics(self, trained: int) -> dict:
        """The step's groups dropped and their share of the groups that reached a decision."""
        if not self.cfg.dynamic_sampling:
            return {}
        seen = self.dropped + trained
        return {"groups_dropped_equal_rewards": self.dropped,
                "dynamic_sampling_dropped_share": self.dropped / seen if seen else 0.0}
