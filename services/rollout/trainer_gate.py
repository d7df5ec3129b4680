"""When a rollout worker may start a new group: the trainer's presence and policy version (the
store's WatchPolicyVersion) and the store's backlog budget."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from services.common.staleness import too_stale
from services.rollout.config import RolloutConfig
from services.rollout.engine import RolloutEngine
from services.rollout.report import WorkerSummary
from services.rollout.sink import TrajectorySink, wait_for_room

log = logging.getLogger(__name__)

ROOM_POLL_S = 0.5  # how often a worker held by the store's backlog budget asks again


class TrainerGate:
    """Holds a worker's new groups while the trainer is gone or too far ahead, or the store is
    full."""

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, sink: TrajectorySink | None,
                 metrics: dict[str, Any]) -> None:
        self.cfg = cfg
        self.engine = engine
        self.sink = sink
        self.metrics = metrics
        self.trainer_version: int | None = None
        # Cleared while a trainer that was present is gone (the job ended): no new group then
        self.trainer_present = asyncio.Event()
        self.trainer_present.set()

    def trainer_state(self, version: int, gone: bool) -> None:
        """The store's policy version and trainer presence (WatchPolicyVersion), on the loop."""
        self.trainer_version = version
        if gone == self.trainer_present.is_set():
            log.warning("trainer %s: %s", *(("gone", "no new group until one is present")
                                            if gone else ("present", "generating again")))
            self.metrics["r3flow_rollout_trainer_gone"].set(int(gone))
            (self.trainer_present.clear if gone else self.trainer_present.set)()

    async def wait_for_room(self, summary: WorkerSummary) -> None:
        """Hold a new group while a trainer that was present is gone (the job ended: stopping
        it stops the spend), while the trainer is more than max_policy_lag versions ahead of
        this engine, then while the store's backlog budget has no room for it and for this
        worker's groups not sent yet. The budget hold needs no new version to end it: it lasts
        exactly as long as the trainer consumes nothing (down, restarting, checkpointing)."""
        await self.trainer_present.wait()
        while self.trainer_version is not None and too_stale(
                self.trainer_version, self.engine.policy_version, self.cfg.max_policy_lag):
            await asyncio.sleep(0.1)
        if self.sink is not None:
            await wait_for_room(self.sink, lambda: summary.groups_in_flight,
                                ROOM_POLL_S)
