"""Where every trajectory of a local run went: trained, dropped (by reason) or left over.

Sources are independent where possible: `produced` from the store's count of complete
trajectories (cross-checked against the trajectories the workers' summaries say they sent: a
worker stopped or killed while sending a group may leave some of its trajectories in the store,
never fewer than it reported), the workers' abandoned/failed/killed-in-flight trajectories from
their summaries (a SIGKILLed worker's last progress summary),
`trained` from groups the trainer acked, drops from the store's counters (by reason: stale,
aborted, quarantined, and dead-lettered groups, which are neither trained nor lost), `unused at
end` from draining the store after the trainer stopped, `leased at stop` from the store's count of
delivered, un-acked groups (a run cut short while the trainer held a partial batch). The remainder (trajectories of groups that were
still incomplete when the workers stopped) is reported, not hidden.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class WorkerTotals:
    """Sums over every rollout worker incarnation's summary (trajectories)."""

    sent: int = 0
    failed: int = 0
    abandoned: int = 0  # cut by a stop request (SIGTERM) after the grace period
    killed_in_flight: int = 0  # groups a SIGKILLed worker had started and not finished

    @classmethod
    def of(cls, summaries: list[dict], group_size: int) -> WorkerTotals:
        t = cls()
        for s in summaries:
            t.sent += s["trajectories_sent"]
            t.failed += s["trajectories_failed"]
            t.abandoned += s["trajectories_abandoned"]
            t.killed_in_flight += group_size * s["groups_in_flight"]
        return t


@dataclass
class Accounting:
    produced: int  # complete trajectories the store received from the workers
    workers_reported: int  # trajectories the workers' summaries say they sent
    trained: int
    dropped: dict[str, int]
    unused_at_end: int
    in_incomplete_groups: int
    max_in_flight: int  # trajectories the workers may have had open at once
    workers: WorkerTotals = field(default_factory=WorkerTotals)
    # Delivered to a trainer that was stopped before it acked them (a run cut short): the
    # store redelivers them after their lease, so they are neither trained nor lost.
    leased_at_stop: int = 0

    @property
    def balanced(self) -> bool:
        """The remainder can only be trajectories of groups the workers had not finished when
        they stopped: never negative, and never more than the workers can hold in flight."""
        return (0 <= self.in_incomplete_groups <= self.max_in_flight
                and self.workers_reported <= self.produced)

    def as_dict(self) -> dict:
        return {**asdict(self), "balanced": self.balanced}

    @classmethod
    def collect(cls, store_addr: str, summaries: list[dict], group_size: int,
                max_in_flight: int, auth=None) -> Accounting:
        """`auth`: a services.common.auth.ClientAuth for a secured store (None: plaintext)."""
        from services.store.client import StoreClient

        with StoreClient(store_addr, timeout_s=10, max_retries=3, auth=auth) as client:
            before = client.stats()
            trained = int(before.groups_acked) * group_size
            unused = drain(client)
            after = client.stats()
        dropped = {k: int(v) for k, v in after.dropped_by_reason.items() if v}
        complete = int(after.trajectories_complete)
        leased = int(after.groups_leased) * group_size
        rest = complete - trained - sum(dropped.values()) - unused - leased
        workers = WorkerTotals.of(summaries, group_size)
        return cls(complete, workers.sent, trained, dropped, unused, rest, max_in_flight,
                   workers, leased_at_stop=leased)


def drain(client, consumer: str = "local-drain") -> int:
    """Pull and ack every ready group (never trained); returns their trajectory count."""
    count = 0
    while True:
        groups = client.pull(consumer, max_groups=64, lease_seconds=60, wait_ms=500)
        if not groups:
            return count
        count += sum(len(g.trajectories) for g in groups)
        client.ack(consumer, [g.delivery_id for g in groups])
