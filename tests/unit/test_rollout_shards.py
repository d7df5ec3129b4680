"""Rollout data at N pods (docs/rollout-data.md): disjoint shards that cover each prompt once
per epoch across the fleet, a new shuffle each epoch, no end with epochs 0, the shard from a
StatefulSet pod's name, a group seed of its own per pod, the epoch on each trajectory."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from services.common.pb.r3flow.v1 import trajectory_pb2
from services.rollout.config import RolloutConfig
from services.rollout.dataset import PromptRecord, iterate_prompts

RECORDS = [PromptRecord(prompt_id=str(i), answer="0", prompt=f"p{i}") for i in range(23)]


def _take(it, n):
    return list(itertools.islice(it, n))


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_disjoint_and_cover_each_prompt_once_per_epoch(shuffle):
    per_epoch: dict[int, Counter] = {}
    for shard in range(4):
        for epoch, rec in iterate_prompts(RECORDS, 3, None, shard=shard, num_shards=4,
                                          shuffle=shuffle, seed=7):
            per_epoch.setdefault(epoch, Counter())[rec.prompt_id] += 1
    assert sorted(per_epoch) == [0, 1, 2]
    for counts in per_epoch.values():
        assert counts == Counter({r.prompt_id: 1 for r in RECORDS})


def test_each_epoch_is_a_new_shuffle_the_same_on_every_worker():
    def order(epoch_count):
        return [r.prompt_id for _, r in iterate_prompts(RECORDS, epoch_count, None,
                                                        shuffle=True, seed=3)]
    both = order(2)
    first, second = both[:23], both[23:]
    assert first != second and sorted(first) == sorted(second)
    assert first != [r.prompt_id for r in RECORDS]
    assert order(2) == both  # deterministic: every pod computes the same permutation


def test_epochs_zero_never_ends_and_records_the_epoch():
    got = _take(iterate_prompts(RECORDS, 0, None, shard=1, num_shards=2, shuffle=True), 100)
    assert len(got) == 100 and got[-1][0] == 9  # 11 prompts a pass in shard 1 of 2
    assert [e for e, _ in got[:12]] == [0] * 11 + [1]


def test_more_shards_than_prompts_is_refused():
    with pytest.raises(ValueError, match="cannot feed"):
        next(iterate_prompts(RECORDS[:2], 1, None, shard=0, num_shards=3))


def _cfg(**kw) -> RolloutConfig:
    return RolloutConfig.model_validate({"engine": {"model": "m"}, "dataset": "d.jsonl", **kw})


def test_shard_comes_from_the_statefulset_ordinal():
    assert _cfg(worker_id="r3flow-rollout-3", num_shards=4).shard_index == 3
    assert _cfg(worker_id="anything").shard_index == 0
    assert _cfg(worker_id="x", shard=1, num_shards=2).shard_index == 1
    with pytest.raises(ValueError, match="num_shards 4"):
        _cfg(worker_id="r3flow-rollout-4", num_shards=4)
    with pytest.raises(ValueError, match="trailing|ending in -N"):
        _cfg(worker_id="rollout", num_shards=2)


def test_group_seeds_differ_across_the_fleet():
    from services.rollout.worker import RolloutWorker

    seeds = set()
    for shard in range(4):
        w = RolloutWorker.__new__(RolloutWorker)  # only the config is read
        w.cfg = _cfg(worker_id=f"r3flow-rollout-{shard}", num_shards=4)
        seeds |= {w._group_seed(seq) for seq in range(50)}
    assert len(seeds) == 200


def test_trajectory_carries_its_epoch():
    msg = trajectory_pb2.Trajectory(trajectory_id="t", epoch=5)
    assert trajectory_pb2.Trajectory.FromString(msg.SerializeToString()).epoch == 5
