"""Trainer ranks as Ray actors (local Ray on 127.0.0.1): 2 CPU ranks, gloo, expert parallel 2,
driven by the TrainLoop (driver pulls, scatters whole groups, acks after the checkpoint)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(300)


class ListStore:
    """In-memory stand-in for StoreClient's trainer side (pull / ack / publish_policy_version)."""

    def __init__(self, groups) -> None:
        self.ready, self.acked, self.versions = list(groups), [], []

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0):
        got, self.ready = self.ready[:max_groups], self.ready[max_groups:]
        return got

    def ack(self, consumer, delivery_ids):
        self.acked += list(delivery_ids)
        return len(delivery_ids)

    def publish_policy_version(self, v):
        self.versions.append(v)
        return v


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

    from services.rollout.tiny_moe import TinyMoeConfig, build_tiny_moe
    from trainer.config import TrainerConfig
    from trainer.ray_launch import RayRanks
    from trainer.step import TrainLoop

    model = build_tiny_moe(tmp_path / "tiny", TinyMoeConfig(num_layers=3, first_k_dense=1))
    cfg = TrainerConfig(model_dir=str(model), model={"expert_parallel": 2},
                        replay={"mode": "r2"}, data={"groups_per_step": 2, "micro_batch_size": 2},
                        run={"launcher": "ray", "world_size": 2, "run_dir": str(tmp_path / "run"),
                             "checkpoint_every": 1})
    store = ListStore(_groups(4))
    ranks = RayRanks(cfg, world_size=2)
    try:
        loop = TrainLoop(cfg, ranks, store)
        history = loop.run(2)
        per_rank = ranks.call("train", [([g.SerializeToString()],) for g in _groups(2)])
    finally:
        ranks.shutdown()
        ray.shutdown()
    assert [m["policy_version"] for m in history] == [1, 2]
    assert store.acked == ["d0", "d1", "d2", "d3"] and store.versions[-1] == 2
    assert per_rank[0]["grad_norm"] == pytest.approx(per_rank[1]["grad_norm"], rel=1e-6)
    assert per_rank[0]["entropy"] != per_rank[1]["entropy"]  # different groups on the two ranks
    log = [json.loads(x) for x in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 2 and all(np.isfinite(x["grad_norm"]) for x in log)
