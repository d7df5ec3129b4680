"""Stand-ins for the trainer loop's ranks and store (TrainLoop's `ranks.call` and the store
client's pull / ack / publish), shared by the loop, step-hook and HF-export tests."""

from __future__ import annotations

from types import SimpleNamespace

from services.common.pb.r3flow.v1 import store_pb2
from trainer.config import TrainerConfig


class FakeRanks:
    """`world_size` ranks whose `train` returns one step's metrics per rank; every call is
    recorded in `calls` as (method, per-rank args)."""

    def __init__(self, world_size: int) -> None:
        self.world_size, self.calls, self.version = world_size, [], 0

    def call(self, method, per_rank_args):
        self.calls.append((method, per_rank_args))
        if method == "train":
            self.version += 1
            return [{"policy_version": self.version, "grad_norm": 1.0 + r, "logprob_diff_max": r,
                     "routing_agreement": 0.99, "routing_agreement_by_layer": {0: 0.98, 1: 1.0},
                     "step_seconds": 0.1, "replay": "r3"} for r in range(self.world_size)]
        return [None] * self.world_size


class FakeStore:
    """A store that delivers `groups` in order and records acks and published versions."""

    def __init__(self, groups) -> None:
        self.ready, self.acked, self.versions = list(groups), [], []

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        got, self.ready = self.ready[:max_groups], self.ready[max_groups:]
        return got

    def ack(self, consumer, ids):
        self.acked.append(list(ids))

    def publish_policy_version(self, v):
        self.versions.append(v)

    def list_workers(self):
        return []

    def stats(self):
        return SimpleNamespace(policy_version=max(self.versions, default=0))


def pulled_group(i: int, delivery: str | None = None):
    """A PulledGroup the store delivers: delivery d<i> (or `delivery`), group g<i>."""
    return store_pb2.PulledGroup(delivery_id=delivery or f"d{i}", group_id=f"g{i}")


def loop_config(tmp_path, **data) -> TrainerConfig:
    """Two groups a step, a checkpoint every 2 steps under `tmp_path`; `data` overrides."""
    return TrainerConfig(data={"groups_per_step": 2, **data},
                         run={"run_dir": str(tmp_path), "checkpoint_every": 2})
