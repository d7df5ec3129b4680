"""The trainer's side of the weight push: plan from the store's registered workers, publish it,
broadcast the exported HF weights (services.common.weight_sync), report the new version.

A push to zero registered workers is skipped (logged): rollout pods may come and go.
A failed push raises WeightSyncError naming the member; the next push re-forms the group.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.common.weight_sync import PushReport

log = logging.getLogger(__name__)


class StoreWeightPush:
    """Callable `push(weights, version)` for `TrainLoop.push_fn`."""

    def __init__(self, client, cfg, failure_counter=None) -> None:
        from services.common.weight_sync import WeightSender

        self.failures = 0
        self.failure_counter = failure_counter
        self.client = client
        self.sender = WeightSender(cfg)
        self.last_report: PushReport | None = None

    def __call__(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        workers = self.client.list_workers()
        if not workers:
            log.warning("weight push v%d skipped: no rollout worker registered", version)
            return
        from services.common.weight_sync import WeightSyncError

        plan = self.sender.plan(version, workers)
        self.client.publish_weight_sync(plan)
        try:
            report = self.sender.push(plan, weights.items())
        except WeightSyncError as e:
            # Every receiver discards an aborted push (two-phase commit), so the engines stay
            # consistent on the old version; the next push re-forms the group from whoever
            # is registered then. Training goes on; staleness limits what old rollouts cost.
            self.failures += 1
            if self.failure_counter is not None:
                self.failure_counter.inc()
            log.error("weight push v%d failed, engines keep their weights: %s", version, e)
            return
        self.last_report = report
        log.info("pushed v%d to %d worker(s): %.1f MB in %.2fs (%.2f GB/s)", version,
                 len(workers), report.num_bytes / 1e6, report.seconds, report.gb_s)

    def close(self) -> None:
        self.sender.close()
