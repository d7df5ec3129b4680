"""Trainer ranks as Ray actors (private local Ray): 2 CPU ranks in a placement group, gloo,
expert parallel 2, driven by the TrainLoop (driver pulls, scatters whole groups, acks after the
checkpoint); after every step trainer rank 0 (not the driver) pushes the weights to a receiver."""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)


class ListStore:
    """In-memory stand-in for StoreClient's trainer side (pull / ack / publish_policy_version)."""

    def __init__(self, groups, workers=()) -> None:
        self.ready, self.acked, self.versions = list(groups), [], []
        self.workers, self.plans = list(workers), queue.Queue()

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        got, self.ready = self.ready[:max_groups], self.ready[max_groups:]
        return got

    def ack(self, consumer, delivery_ids):
        self.acked += list(delivery_ids)
        return len(delivery_ids)

    def publish_policy_version(self, v):
        self.versions.append(v)
        return v

    def list_workers(self):
        return self.workers

    def publish_weight_sync(self, plan):
        self.plans.put(plan)


def _receive(plans: queue.Queue, got: list) -> None:
    """A rollout engine's end of the weight sync, in a thread: every plan until None."""
    from services.common.weight_sync import WeightReceiver

    rx = WeightReceiver("rollout-0")
    while (plan := plans.get()) is not None:
        got.append((plan, {n: t.clone() for n, t in rx.receive(plan).named}))


def _groups(n: int):
    from services.common.pb.r3flow.v1 import store_pb2
    from services.store.synthetic import small_group

    rng = np.random.default_rng(0)
    out = []
    for g in range(n):
        trajs = small_group(f"ray-{g}", 2, layers=3, seed=g)
        for t in trajs:  # token ids inside the tiny vocabulary
            t.prompt_token_ids[:] = rng.integers(4, 100, len(t.prompt_token_ids)).tolist()
            for s in t.segments:
                s.token_ids[:] = rng.integers(4, 100, len(s.token_ids)).tolist()
        out.append(store_pb2.PulledGroup(delivery_id=f"d{g}", group_id=f"ray-{g}",
                                         trajectories=trajs, delivery_count=1))
    return out


def test_ray_actors_ep2_train_via_loop(tmp_path):
    import ray
    import torch

    from services.common.pb.r3flow.v1 import store_pb2
    from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
    from trainer.config import TrainerConfig
    from trainer.loop.loop import TrainLoop
    from trainer.ranks.ray_launch import RayRanks
    from trainer.weight_push import StoreWeightPush

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    cfg = TrainerConfig(model_dir=str(model), model={"expert_parallel": 2},
                        replay={"mode": "r2"}, data={"groups_per_step": 2, "micro_batch_size": 2},
                        run={"launcher": "ray", "world_size": 2, "run_dir": str(tmp_path / "run"),
                             "checkpoint_every": 1})
    store = ListStore(_groups(4), [store_pb2.WorkerInfo(worker_id="rollout-0", world_size=1)])
    got: list = []
    rx = threading.Thread(target=_receive, args=(store.plans, got), daemon=True)
    rx.start()
    ranks = RayRanks(cfg, world_size=2)
    try:
        push = StoreWeightPush(store)
        loop = TrainLoop(cfg, ranks, store, push_fn=push)
        history = loop.run(2)
        store.plans.put(None)
        rx.join(timeout=60)
        exported = ranks.call("export_hf", [(), ()])[0]  # for the comparison only
        per_rank = ranks.call("train", [([g.SerializeToString()],) for g in _groups(2)])
    finally:
        store.plans.put(None)
        ranks.shutdown()
        ray.shutdown()
    # rank 0 sent both pushes, advertising its own node (as Ray reports it) and its own port
    assert [p.version for p, _ in got] == [1, 2] and push.failures == 0
    assert {p.master_addr for p, _ in got} == {ranks.nodes[0]}
    assert push.last_report is not None and push.last_report["members"] == ["rollout-0 (rank 1)"]
    last = got[-1][1]
    assert last.keys() == exported.keys()
    for name, t in exported.items():  # what arrived is rank 0's export (bf16 on the wire)
        assert torch.equal(last[name], t.to(last[name].dtype)), name
    assert [m["policy_version"] for m in history] == [1, 2]
    assert store.acked == ["d0", "d1", "d2", "d3"] and store.versions[-1] == 2
    assert per_rank[0]["grad_norm"] == pytest.approx(per_rank[1]["grad_norm"], rel=1e-6)
    assert per_rank[0]["entropy"] != per_rank[1]["entropy"]  # different groups on the two ranks
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(np.isfinite(x["grad_norm"]) for x in log)
