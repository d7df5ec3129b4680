"""A push planned to a rollout worker that then leaves the store (a pod stopping unregisters)
fails at once, naming it (trainer.weight_push.LeaverWatch), instead of waiting out the sender's
join timeout: test_sigterm_stop's trainer sat 60 s+ in such a push while its SIGTERM waited.
Real store (Redis + `r3flow store`), a real sender and receiver (gloo on 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import torch
from store_fixtures import store_process, store_redis  # noqa: F401

from services.common.weight_sync import WeightReceiver, WeightSyncAborted, WeightSyncConfig
from services.store.client import StoreClient
from trainer.weight_push import LeaverWatch, RankSender, StoreWeightPush

JOIN_TIMEOUT_S = 90.0  # what the push would wait for the leaver without the watch


class _RankZero:
    """`Ranks` as StoreWeightPush uses it, for one in-process rank 0 (trainer.ranks.worker's
    plan_push / push_weights without a model): on planning, worker "stays" starts receiving
    and worker "leaves" unregisters without ever joining, as a stopping rollout pod does."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.sender = RankSender(WeightSyncConfig(timeout_s=JOIN_TIMEOUT_S,
                                                  heartbeat_interval_s=0.1,
                                                  heartbeat_timeout_s=2.0), "127.0.0.1")
        self.received: dict[str, object] = {}
        self.threads: list[threading.Thread] = []

    def plan_push(self, version: int, workers: list[bytes]) -> bytes:
        plan = self.sender.plan(version, workers)

        def receive() -> None:
            from services.common.pb.r3flow.v1 import store_pb2

            try:
                self.received["stays"] = WeightReceiver("stays").receive(
                    store_pb2.WeightSyncPlan.FromString(plan))
            except Exception as e:  # noqa: BLE001 (the test reads it)
                self.received["stays"] = e

        self.threads.append(threading.Thread(target=receive))
        self.threads[-1].start()
        assert self.client.unregister_worker("leaves")
        return plan

    def push_weights(self, plan: bytes) -> dict:
        return self.sender.push(plan, [("w", torch.arange(64, dtype=torch.float32))])


def test_a_worker_leaving_before_it_joined_fails_the_push_at_once(store_process):  # noqa: F811
    with StoreClient(store_process.address) as client:
        client.register_worker("stays", "127.0.0.1")
        client.register_worker("leaves", "127.0.0.1")
        ranks = _RankZero(client)
        push = StoreWeightPush(client)
        t0 = time.monotonic()
        push(ranks, 1)  # type: ignore[arg-type]
        took = time.monotonic() - t0
        for t in ranks.threads:
            t.join(30)
        ranks.sender.close()
        client.unregister_worker("stays")
    assert push.failures == 1 and push.last_report is None
    # named after the first leaver check (1 s) and the sender's heartbeat grace (2.5 s), far
    # below the join timeout it waited out before
    assert took < JOIN_TIMEOUT_S / 3, took
    assert isinstance(ranks.received["stays"], WeightSyncAborted), ranks.received
    assert "leaves" in str(ranks.received["stays"])


def test_the_watch_reports_nobody_while_every_member_stays(store_process):  # noqa: F811
    from services.common.pb.r3flow.v1 import store_pb2

    with StoreClient(store_process.address) as client:
        client.register_worker("here", "127.0.0.1")
        sender = RankSender(WeightSyncConfig(timeout_s=20.0), "127.0.0.1")
        workers = [w.SerializeToString() for w in client.list_workers()]
        plan = store_pb2.WeightSyncPlan.FromString(sender.plan(1, workers))
        watch = LeaverWatch(client, plan)
        with watch:
            time.sleep(2.5 * LeaverWatch.LEFT_CHECK_S)  # two checks pass
        client.unregister_worker("here")
        sender.close()
    assert watch.reported == []
