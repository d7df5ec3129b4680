"""The metrics a step reports about what it trained on (trainer.loop.batch_stats): reward mean /
std, accuracy, response length, truncation, MFU and the time by part, in the step log and
Prometheus, and N sample rows per step in samples.jsonl."""

from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from tests.support.fake_loop import FakeRanks, FakeStore, loop_config
from trainer.loop.batch_stats import mfu, rollout_stats, sample_rows
from trainer.loop.loop import TrainLoop
from trainer.loop.metrics import TrainerMetrics

LENGTH, STOP = trajectory_pb2.FINISH_REASON_LENGTH, trajectory_pb2.FINISH_REASON_STOP


def group(i: int, rewards: list[float], lengths: list[int], truncated: int = 0):
    """Group g<i>: one trajectory per reward, 3 prompt tokens, responses of `lengths` tokens
    (the first `truncated` of them stopped at max_tokens)."""
    trajs = [trajectory_pb2.Trajectory(
        trajectory_id=f"g{i}-{j}", group_id=f"g{i}", prompt_id=f"p{i}", reward=r,
        prompt_token_ids=[1, 2, 3], finish_reason=LENGTH if j < truncated else STOP,
        segments=[trajectory_pb2.Segment(token_ids=list(range(n)))])
        for j, (r, n) in enumerate(zip(rewards, lengths, strict=True))]
    return store_pb2.PulledGroup(delivery_id=f"d{i}", group_id=f"g{i}", trajectories=trajs)


def test_rollout_stats_of_a_batch() -> None:
    got = rollout_stats([group(0, [1.0, 0.0], [4, 8], truncated=1),
                         group(1, [1.0, 0.5], [2, 10])], correct_reward=1.0)
    assert got == {"reward_mean": 0.625, "reward_std": pytest.approx(0.41457, abs=1e-5),
                   "accuracy": 0.5, "response_length_mean": 6.0, "response_length_max": 10,
                   "truncated_share": 0.25, "sequence_tokens": 24 + 12}
    assert rollout_stats([group(0, [0.5], [1])], correct_reward=0.5)["accuracy"] == 1.0
    assert rollout_stats([], 1.0) == {}


def test_sample_rows_decode_when_a_tokenizer_is_there() -> None:
    groups = [group(0, [1.0, 0.0], [2, 3], truncated=1), group(1, [0.0], [1])]
    (row,) = sample_rows(groups, 1, lambda ids: " ".join(map(str, ids)))
    assert row == {"group_id": "g0", "prompt_id": "p0", "prompt": "1 2 3", "response": "0 1",
                   "reward": 1.0, "finish_reason": "length", "response_length": 2}
    rows = sample_rows(groups, 5, None)
    assert [r["response_token_ids"] for r in rows] == [[0, 1], [0]]


def test_mfu_counts_six_flops_per_param_and_token_for_a_training_pass() -> None:
    # 1e9 active params, 1000 tokens, one training pass (3) + one no-grad pass (1)
    assert mfu(10**9, 1000, 4, 1.0, 1, 8.0) == pytest.approx(2 * 4e12 / 8e12)
    assert mfu(10**9, 1000, 4, 1.0, 2, 8.0) == pytest.approx(0.5)  # two devices' peak
    assert mfu(10**9, 1000, 4, 1.0, 1, None) is None  # no known peak (CPU): no MFU


def test_a_step_logs_exports_and_samples_what_it_trained_on(tmp_path) -> None:
    cfg = loop_config(tmp_path, correct_reward=0.5)
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"sample_rows": 1})})
    registry = CollectorRegistry()
    store = FakeStore([group(0, [1.0, 0.0], [4, 6], truncated=1), group(1, [1.0, 1.0], [2, 2])])
    (m,) = TrainLoop(cfg, FakeRanks(1), store, create_metrics(registry, "trainer")).run(1)
    assert (m["accuracy"], m["reward_mean"], m["truncated_share"]) == (0.75, 0.75, 0.25)
    assert m["learning_rate"] == cfg.optim.lr and m["response_length_max"] == 6
    (logged,) = [json.loads(x) for x in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert logged["reward_std"] == pytest.approx(0.4330127) and logged["step"] == 1
    get = registry.get_sample_value
    assert get("r3flow_trainer_accuracy") == 0.75
    assert get("r3flow_trainer_response_length_mean") == 3.5
    assert get("r3flow_trainer_learning_rate") == cfg.optim.lr
    assert get("r3flow_trainer_time_seconds", {"part": "ranks_step"}) == 0.1
    assert get("r3flow_trainer_time_seconds", {"part": "batch_wait"}) >= 0
    (row,) = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert (row["step"], row["group_id"], row["reward"]) == (1, "g0", 1.0)
    assert row["response_token_ids"] == [0, 1, 2, 3]  # no model_dir: no tokenizer


def test_time_by_part_reaches_prometheus() -> None:
    registry = CollectorRegistry()
    TrainerMetrics.of(create_metrics(registry, "trainer")).export_step(
        {"weight_push_seconds": 2.5, "checkpoint_seconds": 0.5})
    assert registry.get_sample_value("r3flow_trainer_time_seconds", {"part": "weight_push"}) == 2.5
    assert registry.get_sample_value("r3flow_trainer_time_seconds", {"part": "updates"}) is None
