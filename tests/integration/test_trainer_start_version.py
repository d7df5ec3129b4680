"""A new named run against a long-lived release: with no checkpoint the trainer starts at the
store's current policy version (or what its engines serve, if higher), not at 0, so its first
push and published version are newer than anything the store and engines hold."""

from __future__ import annotations

import pytest

from services.store.client import StoreClient
from trainer.config import TrainerConfig
from trainer.loop.loop import TrainLoop

pytestmark = pytest.mark.timeout(120)


class Ranks:
    """Stand-in ranks with no checkpoint; each step makes the next policy version."""

    world_size = 1

    def __init__(self) -> None:
        self.version = 0

    def call(self, method, per_rank_args):
        if method == "set_policy_version":
            self.version = per_rank_args[0][0]
        if method == "train":
            self.version += 1
            return [{"policy_version": self.version}]
        return [None]


def _loop(tmp_path, client, ranks) -> TrainLoop:
    cfg = TrainerConfig(data={"groups_per_step": 1, "consumer": "fresh-run"},
                        run={"run_dir": str(tmp_path)})
    return TrainLoop(cfg, ranks, client)


def test_fresh_run_continues_from_the_store_and_engines(tmp_path, store_process):
    with StoreClient(store_process.address) as client:
        loop = _loop(tmp_path / "zero", client, Ranks())
        loop.resume()  # a store that never saw a version: the run starts at 0
        assert loop.pos.policy_version == 0

        assert client.publish_policy_version(7) == 7  # an earlier run got to 7
        ranks = Ranks()
        loop = _loop(tmp_path / "a", client, ranks)
        loop.resume()
        assert loop.pos.policy_version == ranks.version == 7
        loop.train_step([])
        loop.publish_version()  # after every update, as run() does: the store moves on
        assert client.stats().policy_version == 8
        loop.checkpoint(force=True)

        # An engine a step ahead of the store (a push landed, its publish did not).
        client.register_worker("rollout-0", "127.0.0.1", policy_version=10)
        ranks = Ranks()
        loop = _loop(tmp_path / "b", client, ranks)
        loop.resume()
        assert loop.pos.policy_version == ranks.version == 10
