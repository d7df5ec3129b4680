"""Run fencing: the store's current training run, and which groups belong to it
(docs/store.md, run fencing; services/store/core.py starts runs and drops the others' groups)."""

from __future__ import annotations

from dataclasses import dataclass

from services.store.assemble import Delivery

OTHER_RUN = "other_run"  # sampled by another training run's weights (run fencing)


@dataclass(frozen=True)
class RunFence:
    """The store's current training run: groups tagged with another run id, or with a segment
    sampled below `start_version`, belong to another run and are never delivered."""

    run_id: str
    start_version: int

    def admits(self, d: Delivery) -> bool:
        return d.min_policy_version >= self.start_version and all(
            r in ("", self.run_id) for r in d.run_ids)
