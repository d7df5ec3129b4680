"""What a user reads after a quarantine (issue 43), through the whole trainer path on one CPU
rank (megatron-core): pulled groups as protos -> TrainLoop.train_step -> RankWorker (intake,
GRPO step) -> the step's metrics, the Prometheus registry and `train_log.jsonl`.

  * one MoE layer of one trajectory corrupted, on a model whose first two layers are dense
    (MoE index 2 is the model's layer 4): the step names layer 4 (worst cell, per-layer labels,
    the gauge's `layer`), counts the quarantine by reason and the skipped, re-run update;
  * a NaN rollout logprob (`old_logprobs: trainer`): its group is refused and counted, every
    metric of the step is finite.
The fake store is the only stand-in (acks recorded); the rank and the model are real.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from trainer_fixtures import TINY, natural_samples, randomise_layer

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe
from services.common.wire import routing_to_proto

pytestmark = pytest.mark.timeout(300)
DENSE, LAYERS = 2, 7  # model layers 0-1 dense, 2-6 MoE
BAD_MOE = 2  # the corrupted MoE index: the model's layer 4
BAD_LAYER = DENSE + BAD_MOE


class Store:
    """Hands out the given groups once; records acks (dropped ones with their reason)."""

    def __init__(self, groups) -> None:
        self.ready, self.dropped = list(groups), []

    def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
        got, self.ready = self.ready[:max_groups], self.ready[max_groups:]
        return got

    def ack(self, consumer, ids, dropped=()):
        self.dropped += list(dropped)

    def publish_policy_version(self, v):
        pass


def to_proto(s) -> trajectory_pb2.Trajectory:
    """A natural Sample as an engine would send it: one segment, routing of the MoE layers
    under the model's layer numbers."""
    t = trajectory_pb2.Trajectory(
        trajectory_id=s.trajectory_id, group_id=s.group_id, group_size=2, worker_id="w0",
        prompt_id=s.group_id, prompt_token_ids=s.tokens[:s.prompt_len].tolist(),
        reward=s.reward, finish_reason=trajectory_pb2.FINISH_REASON_STOP)
    seg = t.segments.add(index=0, token_ids=s.tokens[s.prompt_len:].tolist(),
                         logprobs=s.rollout_logprobs.tolist(),
                         loss_mask=bytes([1]) * (s.tokens.size - s.prompt_len))
    seg.routing.append(routing_to_proto(s.routing_TLK, 8, start_row=0,
                                        layer_ids=list(range(DENSE, LAYERS))))
    return t


def groups_of(samples) -> list:
    ids = list(dict.fromkeys(s.group_id for s in samples))
    return [store_pb2.PulledGroup(delivery_id=f"d-{g}", group_id=g, trajectories=[
        to_proto(s) for s in samples if s.group_id == g]) for g in ids]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_moe(tmp_path_factory.mktemp("tiny"), TinyMoeConfig(
        num_layers=LAYERS, first_k_dense=DENSE, **TINY))


def step(model_dir, tmp_path, samples, **cfg):
    """One TrainLoop step over `samples` on a fresh in-process rank: (metrics as logged, the
    Prometheus registry, the store)."""
    from trainer.config import TrainerConfig
    from trainer.loop.loop import TrainLoop
    from trainer.ranks.local_ranks import LocalRanks

    config = TrainerConfig.model_validate({
        "model_dir": str(model_dir), "optim": {"lr": 1e-3},
        "run": {"run_dir": str(tmp_path)}} | cfg)
    registry, store = CollectorRegistry(), Store(groups_of(samples))
    loop = TrainLoop(config, LocalRanks(config), store, create_metrics(registry, "trainer"))
    loop.record(loop.train_step(loop.pull_batch()))
    logged = json.loads((tmp_path / "train_log.jsonl").read_text().splitlines()[-1])
    return logged, registry, store


def test_a_one_layer_corruption_is_named_by_model_layer_and_counted(model_dir, tmp_path):
    samples = natural_samples(model_dir, [0.0, 1.0, 1.0, 0.0], seed=4)
    randomise_layer(samples[3], BAD_MOE)  # trajectory t3, group g1
    m, registry, store = step(model_dir, tmp_path, samples, data={
        "groups_per_step": 2, "micro_batch_size": 2}, replay={"agreement_floor": 0.5})
    assert store.dropped == [("d-g1", "routing_agreement", 2)]
    assert m["groups_quarantined"] == 1
    assert m["groups_quarantined_by_reason"] == {"routing_agreement": 1}
    assert (m["updates_skipped"], m["updates_rerun"]) == (1, 1)
    # the worst cell of the faulting pass, not a healthy cell of the re-run
    assert m["routing_agreement_worst_layer"] == BAD_LAYER
    assert "trajectory t3" in m["routing_agreement_worst"]
    assert f"(HF layer {BAD_LAYER})" in m["routing_agreement_worst"]
    assert m["routing_agreement_min"] < 0.5 and m["routing_agreement"] > 0.9  # re-run: healthy
    assert set(m["routing_agreement_by_layer"]) == {str(h) for h in range(DENSE, LAYERS)}
    get = registry.get_sample_value
    for h in range(DENSE, LAYERS):
        assert get("r3flow_trainer_routing_agreement_ratio", {"layer": str(h)}) is not None, h
    for h in range(DENSE):  # dense layers route nothing: no series (MoE indices 0, 1 were)
        assert get("r3flow_trainer_routing_agreement_ratio", {"layer": str(h)}) is None, h
    assert get("r3flow_trainer_groups_quarantined_total", {"reason": "routing_agreement"}) == 1
    assert get("r3flow_trainer_updates_skipped_total") == 1
    assert get("r3flow_trainer_updates_rerun_total") == 1


def _numbers(m, at=""):
    for k, v in m.items():
        if isinstance(v, dict):
            yield from _numbers(v, f"{at}{k}.")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            yield f"{at}{k}", float(v)


def test_a_nan_rollout_logprob_is_refused_counted_and_every_metric_finite(model_dir, tmp_path):
    samples = natural_samples(model_dir, [0.0, 1.0, 1.0, 0.0], seed=5)
    samples[2].rollout_logprobs[1] = np.float32("nan")  # trajectory t2, group g1
    m, registry, store = step(model_dir, tmp_path, samples, data={
        "groups_per_step": 2, "micro_batch_size": 2, "old_logprobs": "trainer"},
        replay={"agreement_floor": 0.5, "compare_off": True})
    assert store.dropped == [("d-g1", "non_finite_logprobs", 2)]
    assert m["groups_quarantined_by_reason"] == {"non_finite_logprobs": 1}
    assert (m["updates_skipped"], m["updates_rerun"]) == (0, 0)  # refused before any pass
    assert m["trajectories"] == 2 and m["updates"] >= 1
    got = dict(_numbers(m))
    assert {"logprob_diff_mean", "logprob_diff_max", "logprob_diff_mean_off", "loss",
            "grad_norm", "routing_agreement_min"} <= set(got), sorted(got)
    assert all(math.isfinite(v) for v in got.values()), {
        k: v for k, v in got.items() if not math.isfinite(v)}
    assert registry.get_sample_value("r3flow_trainer_groups_quarantined_total",
                                     {"reason": "non_finite_logprobs"}) == 1
    assert math.isfinite(registry.get_sample_value("r3flow_trainer_logprob_diff_mean"))
