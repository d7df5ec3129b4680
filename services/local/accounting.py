"""Where every trajectory of a local run went: trained, dropped (by reason) or left over.

Sources are independent where possible: `produced` from the store's count of complete
trajectories (cross-checked against the workers' own counters, which can only lag it),
`trained` from groups the trainer acked, drops from the store's counters, `unused at end` from
draining the store after the trainer stopped. The remainder (trajectories of groups that were
still incomplete when the workers stopped) is reported, not hidden.
"""

from __future__ import annotations

import urllib.request
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families


def scrape_counter(url: str, name: str, **labels: str) -> float:
    """Value of counter `name` (matching `labels`) at a /metrics URL; 0 when absent or down."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return 0.0
    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@dataclass
class Accounting:
    produced: int  # complete trajectories the store received from the workers
    workers_reported: int  # the workers' own `ok` counters, read just before they stopped
    trained: int
    dropped: dict[str, int]
    unused_at_end: int
    in_incomplete_groups: int
    max_in_flight: int  # trajectories the workers may have had open at once

    @property
    def balanced(self) -> bool:
        """The remainder can only be trajectories of groups the workers had not finished when
        they stopped: never negative, and never more than the workers can hold in flight."""
        return (0 <= self.in_incomplete_groups <= self.max_in_flight
                and self.workers_reported <= self.produced)

    def as_dict(self) -> dict:
        return {**asdict(self), "balanced": self.balanced}

    @classmethod
    def collect(cls, store_addr: str, workers_reported: float, group_size: int,
                max_in_flight: int) -> Accounting:
        from services.store.client import StoreClient

        with StoreClient(store_addr, timeout_s=10, max_retries=3) as client:
            before = client.stats()
            trained = int(before.groups_acked) * group_size
            unused = drain(client)
            after = client.stats()
        dropped = {k: int(v) for k, v in after.dropped_by_reason.items() if v}
        complete = int(after.trajectories_complete)
        rest = complete - trained - sum(dropped.values()) - unused
        return cls(complete, int(workers_reported), trained, dropped, unused, rest, max_in_flight)


def drain(client, consumer: str = "local-drain") -> int:
    """Pull and ack every ready group (never trained); returns their trajectory count."""
    count = 0
    while True:
        groups = client.pull(consumer, max_groups=64, lease_seconds=60, wait_ms=500)
        if not groups:
            return count
        count += sum(len(g.trajectories) for g in groups)
        client.ack(consumer, [g.delivery_id for g in groups])
