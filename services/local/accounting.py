"""Where every trajectory of a local run went: trained, dropped (by reason) or left over.

Sources are independent where possible: `produced` from the rollout workers' own counters,
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
    produced: int
    stored_complete: int
    trained: int
    dropped: dict[str, int]
    unused_at_end: int
    in_incomplete_groups: int

    @property
    def balanced(self) -> bool:
        accounted = self.trained + sum(self.dropped.values()) + self.unused_at_end
        return accounted + self.in_incomplete_groups == self.produced

    def as_dict(self) -> dict:
        return {**asdict(self), "balanced": self.balanced}

    @classmethod
    def collect(cls, store_addr: str, produced: float, rows: list[dict],
                group_size: int) -> Accounting:
        from services.store.client import StoreClient

        with StoreClient(store_addr, timeout_s=10, max_retries=3) as client:
            before = client.stats()
            trained = int(before.groups_acked) * group_size
            unused = drain(client)
            after = client.stats()
        dropped = {k: int(v) for k, v in after.dropped_by_reason.items() if v}
        complete = int(after.trajectories_complete)
        rest = complete - trained - sum(dropped.values()) - unused
        return cls(int(produced), complete, trained, dropped, unused, rest)


def drain(client, consumer: str = "local-drain") -> int:
    """Pull and ack every ready group (never trained); returns their trajectory count."""
    count = 0
    while True:
        groups = client.pull(consumer, max_groups=64, lease_seconds=60, wait_ms=500)
        if not groups:
            return count
        count += sum(len(g.trajectories) for g in groups)
        client.ack(consumer, [g.delivery_id for g in groups])
