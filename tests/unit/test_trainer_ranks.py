"""Typed rank calls (trainer/loop/ranks.py): every name `Ranks` sends is a RankWorker method
taking those arguments, and the weight push goes through the typed `plan_push`/`push_weights`
(no method names as strings outside `Ranks`)."""

from __future__ import annotations

import inspect

import pytest

from services.common.pb.r3flow.v1 import store_pb2
from trainer.loop.ranks import RANK_METHODS, Ranks
from trainer.ranks.worker import RankWorker
from trainer.weight_push import StoreWeightPush


def test_every_rank_method_is_a_rank_worker_method_with_as_many_parameters():
    for name in RANK_METHODS:
        worker_params = list(inspect.signature(getattr(RankWorker, name)).parameters)[1:]
        typed = getattr(Ranks, name)
        ranks_params = list(inspect.signature(typed).parameters)[1:]
        # same arity (Ranks.train takes every rank's share, Ranks.save a DataPosition)
        assert len(ranks_params) == len(worker_params), name


class Recording:
    """A 2-rank transport that records calls; rank 0 answers."""

    world_size = 2

    def __init__(self, answers: dict) -> None:
        self.calls: list[tuple[str, list[tuple]]] = []
        self.answers = answers

    def call(self, method: str, per_rank_args: list[tuple]) -> list:
        assert hasattr(RankWorker, method), method
        self.calls.append((method, per_rank_args))
        return [self.answers.get(method), None]


class Client:
    def __init__(self) -> None:
        self.published: list[store_pb2.WeightSyncPlan] = []

    def list_workers(self) -> list[store_pb2.WorkerInfo]:
        return [store_pb2.WorkerInfo(worker_id="w0")]

    def publish_weight_sync(self, plan: store_pb2.WeightSyncPlan) -> None:
        self.published.append(plan)


@pytest.mark.parametrize("ok", [True, False])
def test_weight_push_calls_every_rank_through_typed_methods(ok: bool):
    plan = store_pb2.WeightSyncPlan(version=7).SerializeToString()
    report = {"ok": ok, "error": "" if ok else "member w0 died", "members": ["w0"],
              "address": "a:1", "num_bytes": 10, "seconds": 1.0, "gb_s": 1e-8}
    transport = Recording({"plan_push": plan, "push_weights": report})
    client = Client()
    push = StoreWeightPush(client)
    push(Ranks(transport), 7)
    workers = [store_pb2.WorkerInfo(worker_id="w0").SerializeToString()]
    assert transport.calls == [("plan_push", [(7, workers)] * 2),
                               ("push_weights", [(plan,)] * 2)]
    assert [p.version for p in client.published] == [7]
    assert push.failures == (0 if ok else 1)
    assert (push.last_report is report) == ok
