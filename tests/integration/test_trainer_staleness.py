"""Staleness in steps, through a real store over a real redis-server (issue 28): with
checkpoint_every 20 and max_policy_lag 3 the policy version is published after every update
(acks still wait for the checkpoint), and no group older than 3 versions is trained, whether the
trainer drops it at intake or the store at delivery. Ranks are stand-ins (the loop is tested)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from store_fixtures import StoreProcess

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2
from services.store.client import StoreClient
from services.store.synthetic import small_group
from trainer.config import TrainerConfig
from trainer.loop.loop import TrainLoop
from trainer.loop.staleness import staleness

LAG, STEPS = 3, 10
AGES = (5, 4, 3, 0)  # versions behind the trainer of the groups appended for each next step


class StepRanks:
    """Stand-in ranks: record what each step trains (and what the store says meanwhile), then
    append the next step's groups: two older than the lag, two within it."""

    world_size = 1

    def __init__(self, client: StoreClient) -> None:
        self.client, self.version, self.steps = client, 0, []
        self.append_for(0)

    def append_for(self, version: int) -> None:
        for age in AGES:
            gid = f"v{version}-age{age}"
            for t in small_group(gid, 2, seed=version * 10 + age,
                                 policy_version=max(0, version - age)):
                self.client.append_trajectory(t)

    def call(self, method, per_rank_args):
        if method == "set_policy_version":
            self.version = per_rank_args[0][0]
        if method != "train":
            return [None]
        groups = [store_pb2.PulledGroup.FromString(b) for b in per_rank_args[0][0]]
        stats = self.client.stats()
        self.steps.append({"version": self.version, "published": stats.policy_version,
                           "acked": stats.groups_acked,
                           "ages": [staleness(g, self.version) for g in groups]})
        self.version += 1
        self.append_for(self.version)
        return [{"policy_version": self.version, "trajectories": 4}]


@pytest.mark.parametrize("where", ["trainer", "store"])
def test_no_group_older_than_the_lag_is_trained(store_redis, tmp_path: Path, where: str) -> None:
    store = StoreProcess(store_redis.url, tmp_path, key_prefix=f"st-{where}:",
                         max_policy_lag=LAG if where == "store" else None).start()
    try:
        with StoreClient(store.address) as client:
            registry = CollectorRegistry()
            cfg = TrainerConfig(
                data={"store": store.address, "groups_per_step": 2, "wait_ms": 200,
                      "max_policy_lag": LAG if where == "trainer" else None},
                run={"run_dir": str(tmp_path / "run"), "checkpoint_every": 20})
            ranks = StepRanks(client)
            loop = TrainLoop(cfg, ranks, client, create_metrics(registry, "trainer"))
            loop.resume()
            loop.run(STEPS)
            after = client.stats()
    finally:
        store.stop()
    trained_ages = [a for s in ranks.steps for a in s["ages"]]
    assert len(ranks.steps) == STEPS and max(trained_ages) <= LAG, ranks.steps
    # published after every update, while nothing was acked before the one checkpoint (the end)
    assert [s["published"] for s in ranks.steps] == list(range(STEPS)), ranks.steps
    assert all(s["acked"] == 0 for s in ranks.steps) and after.groups_acked == 2 * STEPS
    assert after.policy_version == STEPS
    stale = after.dropped_by_reason["stale"]
    assert stale >= 2 * 2 * (STEPS - 2), after  # two 2-trajectory groups a step, once aged
    counted = registry.get_sample_value("r3flow_trainer_groups_stale_total") or 0
    assert counted == (stale // 2 if where == "trainer" else 0)


class PoisonRanks:
    """Stand-in ranks that die (as an OOM would) on every batch holding the poison group."""

    world_size = 1

    def __init__(self) -> None:
        self.version, self.trained = 0, []

    def call(self, method, per_rank_args):
        if method != "train":
            return [None]
        gids = [store_pb2.PulledGroup.FromString(b).group_id for b in per_rank_args[0][0]]
        if "poison" in gids:
            raise RuntimeError("rank died on group poison")
        self.trained += gids
        self.version += 1
        return [{"policy_version": self.version, "trajectories": 2}]


def test_poison_group_is_dead_lettered_and_the_trainer_goes_on(store_redis,
                                                              tmp_path: Path) -> None:
    import redis

    from services.store.dead_letter import read_dead_letters
    from services.store.keys import Keys

    store = StoreProcess(store_redis.url, tmp_path, key_prefix="poison:", max_redeliveries=2,
                         max_policy_lag=None).start()
    try:
        with StoreClient(store.address) as client:
            for gid in ("poison", "a", "b"):
                for t in small_group(gid, 2, seed=len(gid)):
                    client.append_trajectory(t)
            cfg = TrainerConfig(data={"store": store.address, "groups_per_step": 1,
                                      "wait_ms": 200, "lease_seconds": 1},
                                run={"run_dir": str(tmp_path / "run"), "checkpoint_every": 1})
            for _ in range(3):  # three incarnations crash on it (1 delivery + 2 redeliveries)
                with pytest.raises(RuntimeError, match="poison"):
                    TrainLoop(cfg, PoisonRanks(), client).run(1)
                time.sleep(1.1)  # its lease runs out
            ranks = PoisonRanks()
            TrainLoop(cfg, ranks, client).run(2)  # the next one trains the others
            after = client.stats()
    finally:
        store.stop()
    assert ranks.trained == ["a", "b"]
    assert after.groups_dead_lettered == 1 and after.dropped_by_reason["dead_letter"] == 2
    assert after.groups_acked == 2 and after.groups_ready == after.groups_leased == 0
    r = redis.Redis.from_url(store_redis.url)
    [rec] = read_dead_letters(r, Keys("poison:")).values()
    assert rec.group_id == "poison" and rec.deliveries == 3, rec
