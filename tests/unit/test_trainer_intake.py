"""Pulled groups -> samples on a rank (trainer.samples.intake, as RankWorker.train calls it, with a
stand-in model)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from services.common.pb.r3flow.v1 import store_pb2
from services.store.synthetic import build_trajectory
from trainer.config import TrainerConfig
from trainer.ranks.worker import RankWorker
from trainer.samples.alignment import LayerMap

MOE_LAYERS = (1, 2)  # HF layer 0 is dense


def rank(**cfg) -> RankWorker:
    """A RankWorker around a model stand-in with 8 experts, top-2, MoE at HF layers 1 and 2."""
    w = RankWorker.__new__(RankWorker)
    w.cfg = TrainerConfig.model_validate(cfg)
    w.trainer = SimpleNamespace(
        backend=SimpleNamespace(moe_layers=MOE_LAYERS, num_experts=8, top_k=2),
        layer_map=lambda ids: LayerMap.build(MOE_LAYERS, ids))
    return w


def trajectory(tid: str, engine_layers: tuple[int, ...], seed: int):
    """(trajectory whose routing columns are `engine_layers`, true [T, L_moe, K] routing)."""
    rng = np.random.default_rng(seed)
    rows, by_layer = 8 + 5 - 1, {}
    for h in (0, 1, 2, 3):
        by_layer[h] = np.stack([rng.permutation(8)[:2] for _ in range(rows)]).astype(np.uint8)
    ids_TLK = np.stack([by_layer[h] for h in engine_layers], axis=1)
    t = build_trajectory(tid, "g0", 2, prompt_ids_TLK=ids_TLK[:8], response_ids_TLK=ids_TLK[8:],
                         segment_lengths=[3, 2], num_experts=8, seed=seed)
    for s in t.segments:
        for c in s.routing:
            c.layer_ids[:] = list(engine_layers)
    return t, np.stack([by_layer[h] for h in MOE_LAYERS], axis=1)


def group(*trajs) -> store_pb2.PulledGroup:
    return store_pb2.PulledGroup(delivery_id="1-0", group_id="g0", trajectories=list(trajs))


def align(w: RankWorker, g: store_pb2.PulledGroup) -> list:
    """The group's samples: each trajectory's routing -> its layer map -> the MoE layers."""
    from trainer.samples.intake import group_samples

    return group_samples(g, w.cfg.replay.mode, w.trainer.layer_map, 8, 2)


def test_every_trajectory_is_mapped_with_its_own_layer_ids():
    a, truth_a = trajectory("t0", (0, 1, 2), seed=1)
    b, truth_b = trajectory("t1", (2, 1, 0), seed=2)  # another engine's column order
    samples = align(rank(), group(a, b))
    for s, truth in zip(samples, (truth_a, truth_b), strict=True):
        assert s.routing_TLK is None  # left encoded at intake: decoded per micro-batch
        assert np.array_equal(np.sort(s.routing(), -1), np.sort(truth, -1))


def test_a_trajectory_lacking_a_moe_layer_is_refused_even_when_not_first():
    a, _ = trajectory("t0", (0, 1, 2), seed=1)
    b, _ = trajectory("t1", (0, 1, 3), seed=2)  # HF layer 2 missing
    with pytest.raises(ValueError, match=r"lacks MoE layers \[2\]"):
        align(rank(), group(a, b))


def test_a_bad_group_is_quarantined_with_a_reason_and_the_rest_kept():
    from trainer.replay import ReplayMode
    from trainer.samples.intake import intake_groups

    good, _ = trajectory("t0", (0, 1, 2), seed=1)
    bad, _ = trajectory("t1", (0, 1, 3), seed=2)  # lacks MoE layer 2
    odd, _ = trajectory("t2", (0, 1, 2), seed=3)
    odd.segments[1].sampling.temperature, odd.segments[1].sampling.top_p = 1.0, 0.9
    groups = [store_pb2.PulledGroup(group_id=g, trajectories=[t])
              for g, t in (("ga", good), ("gb", bad), ("gc", odd))]
    w = rank()
    samples, dropped = intake_groups(groups, ReplayMode.R3, w.trainer.layer_map, 8, 2)
    assert [s.trajectory_id for s in samples] == ["t0"]
    assert dropped == {"gb": "bad_routing", "gc": "unreproducible_sampling"}
