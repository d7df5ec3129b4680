"""Run fencing (docs/store.md): a run started on a store that served another run gets a policy
version above everything before it and pushes its initial weights before it takes a group; the
store drops every group of another run (`other_run`), so no run trains another's samples.

The store is the real one (gRPC server in this process, embedded redis-server); the trainer is
the real TrainLoop with stand-in ranks; the rollout engines are a stand-in that serves what the
last push sent and appends groups sampled at that (version, run)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from services.common.pb.r3flow.v1 import store_pb2
from services.store.client import StoreClient
from services.store.config import StoreConfig
from services.store.core import TrajectoryStoreCore
from services.store.redis_server import EmbeddedRedis
from services.store.server import StoreServer
from services.store.synthetic import small_group
from trainer.config import TrainerConfig
from trainer.loop.ledger import read_trained_ids
from trainer.loop.loop import TrainLoop

GROUP = 2  # trajectories per group


class Ranks:
    """Stand-in ranks: no checkpoint to resume; each step makes the next version; records the
    groups each step trained."""

    world_size = 1

    def __init__(self) -> None:
        self.version, self.trained = 0, []

    def call(self, method, per_rank_args):
        if method == "set_policy_version":
            self.version = per_rank_args[0][0]
        if method == "train":
            self.version += 1
            self.trained.append([store_pb2.PulledGroup.FromString(b) for b in per_rank_args[0][0]])
            return [{"policy_version": self.version}]
        return [None]


class Engines:
    """The rollout fleet: serves the last pushed (version, run); `sample` appends a group."""

    def __init__(self, client: StoreClient) -> None:
        self.client, self.version, self.run_id, self.n = client, 0, "", 0
        client.register_worker("rollout-0", "127.0.0.1")

    def push(self, ranks, version: int, run_id: str) -> None:  # TrainLoop's push_fn
        self.version, self.run_id = version, run_id
        self.client.register_worker("rollout-0", "127.0.0.1", policy_version=version,
                                    run_id=run_id)

    def sample(self, run_id: str | None = None) -> list[str]:
        """A group sampled now (tagged with `run_id` if given: a group begun earlier)."""
        self.n += 1
        group = small_group(f"g{self.n}", GROUP, seed=self.n, policy_version=self.version)
        for t in group:
            t.run_id = self.run_id if run_id is None else run_id
            self.client.append_trajectory(t)
        return [t.trajectory_id for t in group]


@pytest.fixture
def client(tmp_path) -> Iterator[StoreClient]:
    with EmbeddedRedis(tmp_path / "redis") as server:
        cfg = StoreConfig(listen="127.0.0.1:0", key_prefix=f"f{uuid.uuid4().hex[:6]}:")
        store = StoreServer(cfg, TrajectoryStoreCore(redis.Redis.from_url(server.url), cfg))
        store.start()
        try:
            with StoreClient(f"127.0.0.1:{store.port}") as c:
                yield c
        finally:
            store.stop(0)


def _loop(run_dir, client: StoreClient, ranks: Ranks, engines: Engines) -> TrainLoop:
    cfg = TrainerConfig(data={"groups_per_step": 1, "consumer": "trainer", "wait_ms": 50},
                        run={"run_dir": str(run_dir), "checkpoint_every": 1,
                             "exit_engine_wait_s": 0})
    return TrainLoop(cfg, ranks, client, push_fn=engines.push)


def test_a_new_run_trains_none_of_the_previous_runs_groups(tmp_path, client):
    engines = Engines(client)
    a = _loop(tmp_path / "a", client, Ranks(), engines)
    a.resume()  # a pristine store: run A starts at v0, the engines' weights from disk
    assert (client.stats().run_id, client.stats().run_start_version) == (a.pos.run_id, 0)
    for _ in range(3):
        engines.sample()
        assert len(a.run(1)) == 1  # each step pushes: the next group is sampled by it
    assert engines.version == a.pos.policy_version == 3
    left_by_a = engines.sample() + engines.sample()  # run A stops with these ready
    in_flight = engines.run_id  # and one group begun under A, sent after B started

    ranks_b = Ranks()
    b = _loop(tmp_path / "b", client, ranks_b, engines)
    b.resume()
    assert b.pos.run_id != a.pos.run_id
    # B is above every version of A, and its initial weights reached the engines at resume
    assert engines.version == b.pos.policy_version == 4 and engines.run_id == b.pos.run_id
    assert client.stats().run_start_version == 4
    left_by_a += engines.sample(run_id=in_flight)
    own = engines.sample()
    assert len(b.run(1)) == 1

    [first_step] = ranks_b.trained
    got = [t for g in first_step for t in g.trajectories]
    assert [t.trajectory_id for t in got] == own
    assert {(t.run_id, s.policy_version) for t in got for s in t.segments} == {
        (b.pos.run_id, 4)}
    trained_by_b = read_trained_ids(tmp_path / "b" / "trained_ids.jsonl")
    assert not set(left_by_a) & {t for ids in trained_by_b.values() for t in ids}
    assert client.stats().dropped_by_reason["other_run"] == len(left_by_a) == 3 * GROUP


def test_only_another_run_moves_the_fence(client):
    """A trainer restarted from its checkpoint is the same run: its version only rises."""
    first = client.start_run("run-a", 0)
    assert (first.version, first.run_start_version) == (0, 0)  # pristine: nothing to fence
    assert client.start_run("run-a", 5).version == 5  # the same run only raises
    other = client.start_run("run-b", 5)
    assert (other.version, other.run_start_version) == (6, 6)
    again = client.start_run("run-b", 6)
    assert (again.version, again.run_start_version) == (6, 6)
    with pytest.raises(ValueError, match="run_id"):
        client.start_run("", 1)
