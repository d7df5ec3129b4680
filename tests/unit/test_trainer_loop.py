"""TrainLoop bookkeeping with stand-in ranks and store: scatter by group, ack only after the
checkpoint, redelivered groups are not retrained, metrics reach Prometheus and the JSONL log."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2
from services.store.errors import UnackedFull
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config, pulled_group
from trainer.loop.loop import TrainLoop
from trainer.loop.metrics import reduce_metrics


def test_groups_scatter_ack_after_checkpoint_and_metrics(tmp_path):
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "trainer")
    ranks, store = FakeRanks(2), FakeStore([pulled_group(i) for i in range(6)])
    loop = TrainLoop(loop_config(tmp_path), ranks, store, metrics)
    loop.run(3)
    trains = [args for m, args in ranks.calls if m == "train"]
    assert [len(a[0][0]) for a in trains] == [1, 1, 1]  # one whole group per rank per step
    assert store.acked == [["d0", "d1", "d2", "d3"], ["d4", "d5"]]  # step 2 ckpt, final ckpt
    assert [m for m, _ in ranks.calls].count("save") == 2 and store.versions == [1, 2, 3]
    assert registry.get_sample_value("r3flow_trainer_grad_norm") == 1.5  # mean over ranks
    assert registry.get_sample_value("r3flow_trainer_logprob_diff_max") == 1.0  # max over ranks
    assert registry.get_sample_value("r3flow_trainer_routing_agreement_ratio",
                                     {"layer": "1"}) == 1.0
    assert registry.get_sample_value("r3flow_trainer_updates_skipped_total") == 0  # none faulted
    assert registry.get_sample_value("r3flow_trainer_steps_total") == 3
    # the stall alert's inputs: when the last step completed, and how long after the one before
    log_times = [json.loads(x)["time"] for x in (tmp_path / "train_log.jsonl").read_text()
                 .splitlines()]
    last = registry.get_sample_value("r3flow_trainer_last_step_timestamp_seconds")
    assert last == pytest.approx(log_times[-1], abs=1.0)
    assert 0 < registry.get_sample_value("r3flow_trainer_step_interval_seconds") <= \
        log_times[-1] - log_times[-2] + 1.0
    log = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in log] == [1, 2, 3]


def test_redelivered_trained_group_is_acked_not_retrained(tmp_path):
    ranks = FakeRanks(1)
    store = FakeStore([pulled_group(0), pulled_group(1), pulled_group(0, "d0-again"), pulled_group(2), pulled_group(3)])
    loop = TrainLoop(loop_config(tmp_path), ranks, store)
    loop.run(2)
    trained = [store_pb2.PulledGroup.FromString(b).group_id
               for m, args in ranks.calls if m == "train" for b in args[0][0]]
    assert trained == ["g0", "g1", "g2", "g3"]
    assert "d0-again" in store.acked[0]


def test_store_full_of_unacked_groups_gets_an_early_checkpoint(tmp_path):
    """The store refuses a pull while it holds max_unacked_tokens of delivered groups: the
    trainer checkpoints at once (acking what it trained) instead of at checkpoint_every."""

    class BoundedStore(FakeStore):
        def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
            held = len(self.delivered) - sum(len(a) for a in self.acked)
            if held >= 4:  # two steps of groups delivered and not acked
                raise UnackedFull("pull: store over max_unacked_tokens=...")
            got = super().pull(consumer, max_groups)
            self.delivered += [g.delivery_id for g in got]
            return got

    ranks, store = FakeRanks(1), BoundedStore([pulled_group(i) for i in range(10)])
    store.delivered = []
    cfg = loop_config(tmp_path)
    cfg.run.checkpoint_every = 1000
    assert len(TrainLoop(cfg, ranks, store).run(5)) == 5
    # early checkpoints after steps 2 and 4, the final one after step 5
    assert store.acked == [["d0", "d1", "d2", "d3"], ["d4", "d5", "d6", "d7"], ["d8", "d9"]]


def test_groups_per_step_must_split_evenly_between_ranks(tmp_path):
    with pytest.raises(ValueError, match="groups_per_step"):
        TrainLoop(loop_config(tmp_path, groups_per_step=3), FakeRanks(2), FakeStore([]))


def test_reduce_metrics():
    got = reduce_metrics([{"a": 1.0, "x_max": 1.0, "d": {0: 1.0}, "s": "r3"},
                          {"a": 3.0, "x_max": 5.0, "d": {0: 0.0}, "s": "r3"}])
    assert got == {"a": 2.0, "x_max": 5.0, "d": {0: 0.5}, "s": "r3"}
    # the worst rank's minimum is the step's minimum (a mean would hide a bad rank)
    assert reduce_metrics([{"routing_agreement_min": 0.9}, {"routing_agreement_min": 0.4}]) == {
        "routing_agreement_min": 0.4}


def test_reduce_metrics_names_the_worst_cell_of_the_rank_that_holds_the_minimum():
    """The worst cell and its layer come with the minimum (rank 1's), not rank 0's; the
    skipped / re-run counts (alike on every rank) stay ints."""
    got = reduce_metrics([
        {"routing_agreement_min": 0.9, "routing_agreement_worst": "t0 (HF layer 2)",
         "routing_agreement_worst_layer": 2, "updates_skipped": 1, "updates_rerun": 1},
        {"routing_agreement_min": 0.3, "routing_agreement_worst": "t3 (HF layer 4)",
         "routing_agreement_worst_layer": 4, "updates_skipped": 1, "updates_rerun": 1},
        {"routing_agreement_min": None, "updates_skipped": 1, "updates_rerun": 1}])  # filler
    assert got == {"routing_agreement_min": 0.3, "routing_agreement_worst": "t3 (HF layer 4)",
                   "routing_agreement_worst_layer": 4, "updates_skipped": 1, "updates_rerun": 1}
    assert isinstance(got["updates_skipped"], int)


def test_reduce_metrics_over_the_ranks_that_measured():
    """A rank that trained only padding micro-batches measured no reward and no agreement."""
    got = reduce_metrics([{"reward_mean": None, "routing_agreement": None, "by_layer": {},
                           "trajectories": 0},
                          {"reward_mean": 0.5, "routing_agreement": 0.9, "by_layer": {0: 0.8},
                           "routing_agreement_min": 0.7, "trajectories": 4}])
    assert got == {"reward_mean": 0.5, "routing_agreement": 0.9, "by_layer": {0: 0.8},
                   "routing_agreement_min": 0.7, "trajectories": 4}


class QuarantiningRanks(FakeRanks):
    """Rank 1 quarantines its group (bad routing) and trains on nothing else."""

    def call(self, method, per_rank_args):
        out = super().call(method, per_rank_args)
        if method == "train":
            for r, m in enumerate(out):
                m["dropped"] = {"g1": "invalid_routing"} if r == 1 else {}
        return out


class DroppingStore(FakeStore):
    def __init__(self, groups) -> None:
        super().__init__(groups)
        self.dropped = []

    def ack(self, consumer, ids, dropped=()):
        super().ack(consumer, ids)
        self.dropped += list(dropped)


def test_quarantined_group_is_acked_as_dropped_at_once_and_the_step_goes_on(tmp_path):
    registry = CollectorRegistry()
    metrics = create_metrics(registry, "trainer")
    groups = [store_pb2.PulledGroup(delivery_id=f"d{i}", group_id=f"g{i}", trajectories=[
        {"trajectory_id": f"g{i}/{j}"} for j in range(3)]) for i in range(2)]
    store = DroppingStore(groups)
    loop = TrainLoop(loop_config(tmp_path), QuarantiningRanks(2), store, metrics)
    m = loop.train_step(loop.pull_batch())
    assert store.dropped == [("d1", "invalid_routing", 3)]  # acked now, before any checkpoint
    assert m["groups_quarantined"] == 1 and loop.pending_acks == ["d0"]
    assert m["groups_quarantined_by_reason"] == {"invalid_routing": 1}
    assert loop.pos.trained_group_ids == ["g0"]
    assert registry.get_sample_value("r3flow_trainer_groups_quarantined_total",
                                     {"reason": "invalid_routing"}) == 1.0
    ids = [json.loads(x) for x in (tmp_path / "trained_ids.jsonl").read_text().splitlines()]
    assert ids[-1]["trajectory_ids"] == ["g0/0", "g0/1", "g0/2"]


def _rewarded(i: int, rewards: list[float]):
    return store_pb2.PulledGroup(delivery_id=f"d{i}", group_id=f"g{i}", trajectories=[
        {"trajectory_id": f"g{i}/{j}", "reward": r} for j, r in enumerate(rewards)])


def test_dynamic_sampling_drops_equal_reward_groups_and_refills_the_batch(tmp_path):
    """DAPO dynamic sampling at intake: all-equal groups acked dropped, the batch refilled."""
    store = DroppingStore([_rewarded(0, [1, 1]), _rewarded(1, [0, 1]), _rewarded(2, [0, 0]),
                           _rewarded(3, [1, 0])])
    loop = TrainLoop(loop_config(tmp_path, dynamic_sampling=True), FakeRanks(1), store)
    batch = loop.pull_batch()
    assert [g.group_id for g in batch] == ["g1", "g3"]
    assert store.dropped == [("d0", "equal_rewards", 2), ("d2", "equal_rewards", 2)]
    m = loop.train_step(batch)
    assert m["groups_dropped_equal_rewards"] == 2 and m["dynamic_sampling_dropped_share"] == 0.5
    assert (m["groups_trained"], m["groups_equal_rewards"]) == (2, 0)


def test_a_step_counts_its_groups_without_a_gradient(tmp_path):
    """Without dynamic sampling, equal-reward groups are trained and counted: a step of only
    such groups has a zero gradient, and its log says why."""
    store = DroppingStore([_rewarded(0, [1, 1]), _rewarded(1, [0, 1])])
    loop = TrainLoop(loop_config(tmp_path), FakeRanks(1), store)
    m = loop.train_step(loop.pull_batch())
    assert (m["groups_trained"], m["groups_equal_rewards"]) == (2, 1) and not store.dropped


def test_dynamic_sampling_keeps_equal_groups_past_its_pull_budget(tmp_path):
    store = DroppingStore([_rewarded(i, [1, 1]) for i in range(4)])
    cfg = loop_config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_pulls=1)
    batch = TrainLoop(cfg, FakeRanks(1), store).pull_batch()
    assert [g.group_id for g in batch] == ["g2", "g3"] and len(store.dropped) == 2


def test_off_policy_metrics_reach_prometheus_and_hist_counts_sum_over_ranks():
    from trainer.loop.metrics import TrainerMetrics

    m = reduce_metrics([{"staleness_hist": {"0": 2, "1": 1}, "ppo_kl": None, "is_weight_max": 2.0},
                        {"staleness_hist": {"1": 3}, "ppo_kl": 0.1, "is_weight_max": 4.0,
                         "logprob_diff_mean_fresh": 0.01, "logprob_diff_mean_off_stale": 0.3}])
    assert m["staleness_hist"] == {"0": 2.0, "1": 4.0} and m["ppo_kl"] == 0.1  # filler: None
    registry = CollectorRegistry()
    TrainerMetrics.of(create_metrics(registry, "trainer")).export_step(m | {"mismatch_kl": None})
    get = registry.get_sample_value
    assert get("r3flow_trainer_sample_staleness_versions_count") == 6
    assert get("r3flow_trainer_sample_staleness_versions_bucket", {"le": "0.0"}) == 2
    assert get("r3flow_trainer_is_weight_max") == 4.0
    assert get("r3flow_trainer_logprob_diff_mean_by_staleness",
               {"staleness": "fresh", "routing": "run"}) == 0.01
    assert get("r3flow_trainer_logprob_diff_mean_by_staleness",
               {"staleness": "stale", "routing": "off"}) == 0.3


def test_a_group_in_the_batch_is_not_judged_again_when_redelivered(tmp_path):
    """A resync push raises the version while the batch waits; the batch's own group, taken
    back after its lease, stays in the batch (its newest delivery), and is not dropped stale."""
    from services.common.pb.r3flow.v1 import trajectory_pb2

    def aged(i: int, version: int, delivery: str):
        traj = trajectory_pb2.Trajectory(trajectory_id=f"g{i}-0")
        traj.segments.add(policy_version=version)
        return store_pb2.PulledGroup(delivery_id=delivery, group_id=f"g{i}", trajectories=[traj])

    class Store(FakeStore):
        def __init__(self, loop_ref) -> None:
            super().__init__([])
            self.loop_ref, self.dropped = loop_ref, []
            self.pulls = iter([[aged(0, 0, "d0")], [aged(0, 0, "d0-again")], [aged(1, 5, "d1")]])

        def pull(self, consumer, max_groups, lease_seconds=0, wait_ms=0, session=""):
            got = next(self.pulls)
            if got[0].delivery_id == "d0-again":
                self.loop_ref[0].pos.policy_version = 5  # a resync push happened meanwhile
            return got

        def ack(self, consumer, ids, dropped=()):
            self.dropped += list(dropped)

    ref: list = []
    store = Store(ref)
    loop = TrainLoop(loop_config(tmp_path, max_policy_lag=1), FakeRanks(1), store)
    ref.append(loop)
    batch = loop.pull_batch()
    assert [(g.group_id, g.delivery_id) for g in batch] == [("g0", "d0-again"), ("g1", "d1")]
    assert store.dropped == []
