"""The trainer's presence at the store (TrainerHeartbeat): announced when the trainer starts,
renewed from a thread of its own every third of its TTL (a long step, checkpoint or push never
lets it lapse), withdrawn (`leaving`) when the trainer exits, however it exits. While a trainer
that was present is gone (left, or killed and expired), rollout workers start no new group:
stopping a job stops the spend (docs/operations.md)."""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Any

log = logging.getLogger(__name__)


class TrainerPresence:
    """`with TrainerPresence(client, consumer):` the trainer is present at the store inside;
    `run_id` (set once the run is known) is reported with each renewal."""

    def __init__(self, client: Any, consumer: str) -> None:
        self.client, self.consumer, self.run_id = client, consumer, ""
        self.ttl_s = 30
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="presence", daemon=True)

    def __enter__(self) -> TrainerPresence:
        self.ttl_s = self.client.trainer_heartbeat(self.consumer, self.run_id)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(max(1.0, self.ttl_s / 3)):
            try:
                self.ttl_s = self.client.trainer_heartbeat(self.consumer, self.run_id)
            except Exception as e:  # noqa: BLE001 (a restarting store: renew at the next turn)
                log.warning("trainer presence not renewed: %s", e)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.client.trainer_heartbeat(self.consumer, self.run_id, leaving=True)
            log.info("left the store: rollout workers start no new group until a trainer is "
                     "present again")
        except Exception as e:  # noqa: BLE001 (exiting: the presence expires with its TTL)
            log.warning("could not leave the store (%s): the presence expires in %d s", e,
                        self.ttl_s)
