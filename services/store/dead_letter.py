"""Dead-lettered groups: a group whose lease expired after 1 + `max_redeliveries` deliveries to
different trainer sessions (a trainer that crashes on it, or never acks it) is set aside instead
of delivered again. Its record (reason, deliveries, last holder, trajectory ids) stays in the
hash `<prefix>deadletter`; its last delivery (a serialized PulledGroup) under `<prefix>dl:<gid>`
until tombstone_seconds. Neither is ever delivered to a trainer.

Inspect with `redis-cli HGETALL <prefix>deadletter` or `read_dead_letters`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from services.store.assemble import Delivery
from services.store.keys import Keys

REASON = "dead_letter"  # the dropped_by_reason label of dead-lettered trajectories


@dataclass
class DeadLetter:
    """Why and when one group was dead-lettered."""

    group_id: str
    delivery_id: str
    reason: str
    deliveries: int
    last_consumer: str
    trajectory_ids: list[str]
    min_policy_version: int
    time: float


def dead_letter_of(d: Delivery | None, gid: str, eid: str, deliveries: int, holder: str,
                   max_redeliveries: int) -> DeadLetter:
    """The record of group `gid` (entry `eid`), delivered `deliveries` times, last to `holder`."""
    ids = d.trajectory_ids if d is not None else []
    reason = (f"lease expired after {deliveries} deliveries without an ack (last held by "
              f"{holder or '?'}); store max_redeliveries={max_redeliveries}")
    return DeadLetter(gid, eid, reason, deliveries, holder, ids,
                      d.min_policy_version if d is not None else 0, time.time())


def keep(r: Any, keys: Keys, rec: DeadLetter, d: Delivery | None, ttl_s: int) -> None:
    """Write the record (kept) and the group's last delivery (kept `ttl_s` seconds)."""
    with r.pipeline(transaction=False) as p:
        p.hset(keys.dead_letters, rec.group_id, json.dumps(asdict(rec)))
        if d is not None:
            p.set(keys.dead_letter_group(rec.group_id), d.to_bytes(), ex=ttl_s)
        p.execute()


def read_dead_letters(r: Any, keys: Keys) -> dict[str, DeadLetter]:
    """Group id -> record of every dead-lettered group."""
    return {(k.decode() if isinstance(k, bytes) else k): DeadLetter(**json.loads(v))
            for k, v in r.hgetall(keys.dead_letters).items()}
