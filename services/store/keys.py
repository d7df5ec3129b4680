"""The store's Redis key layout (see docs/store.md); every key starts with the config prefix.

Lua scripts rebuild member keys from the same prefix, so the names here and in
`services/store/lua.py` must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSUMER_GROUP = "trainers"


@dataclass(frozen=True)
class Keys:
    """Key names under one prefix."""

    prefix: str = "r3f:"

    def traj(self, trajectory_id: str) -> str:
        """Hash: header, counters, segment payloads (`s:<j>`) and finish of one trajectory."""
        return f"{self.prefix}t:{trajectory_id}"

    def traj_done(self, trajectory_id: str) -> str:
        """Tombstone of an acked/dropped trajectory, so late retries stay no-ops."""
        return f"{self.prefix}td:{trajectory_id}"

    def group(self, group_id: str) -> str:
        """Hash: size, complete count, oldest policy version, prompt routing chunks (`p:<hash>`)."""
        return f"{self.prefix}g:{group_id}"

    def group_members(self, group_id: str) -> str:
        """Set of trajectory ids begun in the group."""
        return f"{self.prefix}gm:{group_id}"

    def group_done(self, group_id: str) -> str:
        """Tombstone of a released-and-acked or dropped group."""
        return f"{self.prefix}gd:{group_id}"

    @property
    def ready(self) -> str:
        """Stream of complete groups (one entry per group, field `g` = group id)."""
        return f"{self.prefix}ready"

    @property
    def open_groups(self) -> str:
        """Sorted set group id -> time of its first begin (for the group timeout)."""
        return f"{self.prefix}open"

    @property
    def leases(self) -> str:
        """Hash stream entry id -> lease in ms of its current delivery."""
        return f"{self.prefix}leases"

    @property
    def dead_letters(self) -> str:
        """Hash group id -> JSON record of a dead-lettered group (reason, deliveries, ids)."""
        return f"{self.prefix}deadletter"

    def dead_letter_group(self, group_id: str) -> str:
        """The dead-lettered group's last delivery (serialized PulledGroup), for inspection;
        expires after tombstone_seconds."""
        return f"{self.prefix}dl:{group_id}"

    @property
    def stats(self) -> str:
        """Hash of durable counters (appended, complete, backlog_tokens, inflight, ...)."""
        return f"{self.prefix}stats"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}pv"

    @property
    def run(self) -> str:
        """Hash: `id` and `start` (policy version) of the current training run (run fencing)."""
        return f"{self.prefix}run"

    @property
    def trainer(self) -> str:
        """Serialized TrainerPresence of the present trainer, with a TTL (trainer_ttl_seconds)."""
        return f"{self.prefix}trainer"

    @property
    def trainer_seen(self) -> str:
        """Set once a trainer was present: its absence since then means it is gone."""
        return f"{self.prefix}trainer_seen"

    @property
    def weight_sync(self) -> str:
        """Latest WeightSyncPlan (serialized)."""
        return f"{self.prefix}ws"

    def worker(self, worker_id: str) -> str:
        """Serialized WorkerInfo with a TTL."""
        return f"{self.prefix}w:{worker_id}"

    @property
    def worker_pattern(self) -> str:
        return f"{self.prefix}w:*"
