"""A receiver refuses an NCCL push whose sender runs another NCCL version: one error naming
both versions, raised before any collective (no group is formed), reported to the sender."""

from __future__ import annotations

import json

import pytest

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import WeightReceiver, WeightSender, WeightSyncError
from services.common.weight_sync.group import Keys, nccl_mismatch, nccl_version, push_store


def test_mismatch_names_both_versions():
    why = nccl_mismatch("nccl", "2.21.5", "2.27.3", 4, "engine-a (rank 1)")
    assert why is not None and "2.21.5" in why and "2.27.3" in why and "engine-a" in why
    assert nccl_mismatch("nccl", "2.21.5", "2.21.5", 4, "x") is None
    assert nccl_mismatch("gloo", "2.21.5", "", 4, "x") is None  # gloo: no NCCL involved


def test_receiver_refuses_before_any_collective():
    from services.common.weight_sync import WeightSyncConfig

    sender = WeightSender(WeightSyncConfig(timeout_s=5, heartbeat_interval_s=0.1,
                                           heartbeat_timeout_s=1.0))
    try:
        plan = sender.plan(1, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                    world_size=1)])
        store = push_store(sender._root, 1)
        params = json.loads(store.get(Keys.PARAMS))
        theirs = "2.0.1" if nccl_version() != "2.0.1" else "2.0.2"
        store.set(Keys.PARAMS, json.dumps(params | {"nccl_version": theirs}))
        plan.backend = "nccl"  # as an NCCL trainer publishes it
        rx = WeightReceiver("a")
        with pytest.raises(WeightSyncError, match="NCCL version mismatch") as err:
            rx.receive(plan)
        assert theirs in str(err.value) and err.value.members == ("a (rank 1)",)
        assert rx._group is None and not store.check([Keys.join(1)])  # never joined
        assert theirs in store.get(Keys.err(1)).decode()  # the sender is told why
    finally:
        sender.close()
