"""The trainer's side of recovery, with stand-in ranks and store (fast): an idle trainer
re-pushes its weights to a worker behind it, a resumed trainer labels its weights above what
engines serve, and `trained_ids.jsonl` records each step's trajectory ids."""

from __future__ import annotations

import json

import pytest

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from trainer.config import TrainerConfig
from trainer.loop.ledger import read_trained_ids
from trainer.loop.loop import RESYNC_INTERVAL_S, TrainLoop

pytestmark = [pytest.mark.faults]


class Ranks:
    world_size = 1

    def __init__(self, resume_pos: dict | None = None) -> None:
        self.version, self.resume_pos, self.calls = 0, resume_pos, []

    def call(self, method, per_rank_args):
        self.calls.append(method)
        if method == "train":
            self.version += 1
            return [{"policy_version": self.version}]
        if method == "set_policy_version":
            self.version = per_rank_args[0][0]
        return [self.resume_pos if method == "resume" else {}]


class Store:
    def __init__(self, groups, worker_version: int, published: int = 0) -> None:
        self.ready, self.worker_version, self.published = list(groups), worker_version, published

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        got, self.ready = self.ready[:max_groups], self.ready[max_groups:]
        return got

    def ack(self, consumer, ids):
        pass

    def publish_policy_version(self, v):
        self.published = max(self.published, v)

    def start_run(self, run_id, v):  # the store's current run already: only raises
        self.publish_policy_version(v)
        return store_pb2.PolicyVersion(version=self.published, run_id=run_id)

    def list_workers(self):
        return [store_pb2.WorkerInfo(worker_id="rollout-0", policy_version=self.worker_version)]

    def stats(self):
        return store_pb2.StoreStats(policy_version=self.published)


def _group(i: int):
    trajs = [trajectory_pb2.Trajectory(trajectory_id=f"g{i}-{j}") for j in range(2)]
    return store_pb2.PulledGroup(delivery_id=f"d{i}", group_id=f"g{i}", trajectories=trajs)


def _loop(tmp_path, store, ranks, pushes):
    # the stand-in engine never reports the pushed version: no exit wait for it
    cfg = TrainerConfig(data={"groups_per_step": 1},
                        run={"run_dir": str(tmp_path), "checkpoint_every": 1,
                             "exit_engine_wait_s": 0})
    return TrainLoop(cfg, ranks, store, push_fn=lambda w, v, run: pushes.append(v))


def test_idle_trainer_repushes_to_a_worker_behind_it_as_the_next_version(tmp_path):
    pushes: list[int] = []
    store = Store([_group(0)], worker_version=0)
    loop = _loop(tmp_path, store, Ranks(), pushes)
    loop.run(1)
    assert pushes == [1]  # the step's own push; the worker missed it (still at v0)
    polls = iter([False, True])
    assert loop.pull_batch(stop=lambda: next(polls)) == []
    # right after a push the worker may not have reported it yet: no push again so soon
    assert pushes == [1] and loop.pos.policy_version == 1
    loop._last_resync -= RESYNC_INTERVAL_S  # ... but once the interval has passed
    polls = iter([False, True])
    assert loop.pull_batch(stop=lambda: next(polls)) == []
    assert pushes == [1, 2] and loop.pos.policy_version == 2
    store.worker_version = 2
    loop._last_resync = 0.0
    polls = iter([False, True])
    loop.pull_batch(stop=lambda: next(polls))
    assert pushes == [1, 2]  # nobody behind: no push


def test_resumed_trainer_continues_above_the_version_engines_serve(tmp_path):
    pos = {"step": 3, "policy_version": 3, "acked_delivery_ids": [], "trained_group_ids": []}
    ranks, pushes = Ranks(resume_pos=pos), []
    loop = _loop(tmp_path, Store([_group(5)], worker_version=4, published=3), ranks, pushes)
    loop.resume()
    assert loop.pos.policy_version == 4 and ranks.version == 4
    loop.run(1)
    assert pushes == [5]  # newer than the v4 the engine serves: it is not ignored


def test_a_group_redelivered_while_its_batch_waits_is_trained_once(tmp_path):
    """The lease ran out while the batch waited for its second group: the store hands the
    first group to this consumer again; the step takes it once, as its newest delivery."""

    class Redelivering(Store):
        def __init__(self) -> None:
            super().__init__([], worker_version=0)
            again = store_pb2.PulledGroup()
            again.CopyFrom(_group(0))
            again.delivery_id = "d0-again"
            self.pulls = iter([[_group(0)], [], [again], [_group(1)]])

        def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
            return next(self.pulls)

    cfg = TrainerConfig(data={"groups_per_step": 2},
                        run={"run_dir": str(tmp_path), "checkpoint_every": 1})
    loop = TrainLoop(cfg, Ranks(), Redelivering(), push_fn=None)
    batch = loop.pull_batch()
    assert [(g.group_id, g.delivery_id) for g in batch] == [("g0", "d0-again"), ("g1", "d1")]


def test_trained_ids_log_each_step_and_resume(tmp_path):
    loop = _loop(tmp_path, Store([_group(0), _group(1)], worker_version=0), Ranks(), [])
    loop.resume()
    loop.run(2)
    lines = [json.loads(x) for x in (tmp_path / "trained_ids.jsonl").read_text().splitlines()]
    assert lines[0] == {"resumed_at": 0}
    assert read_trained_ids(tmp_path / "trained_ids.jsonl") == {1: ["g0-0", "g0-1"],
                                                                2: ["g1-0", "g1-1"]}
