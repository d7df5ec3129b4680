"""The trained-ids ledger names each group's prompt source, (worker_id, epoch, prompt_id), for
the steps that survived restarts; the epoch travels from the rollout worker through the store's
Append (TrajectoryBegin.epoch) into the trajectory the trainer pulls."""

from __future__ import annotations

import json

from services.common.pb.r3flow.v1 import store_pb2, trajectory_pb2
from services.store.parts import trajectory_requests
from trainer.loop.ledger import TrainedIdsLedger, read_trained_ids, read_trained_prompts


def test_prompts_of_surviving_steps(tmp_path):
    path = tmp_path / "trained_ids.jsonl"
    ledger = TrainedIdsLedger(path)
    ledger.step(1, 1, ["a/0", "a/1"], [("rollout-0", 0, "p7")])
    ledger.step(2, 2, ["b/0"], [("rollout-1", 2, "p3")])
    ledger.resumed(1)  # step 2 rolled back
    ledger.step(2, 2, ["c/0"], [("rollout-1", 0, "p4")])
    assert read_trained_ids(path) == {1: ["a/0", "a/1"], 2: ["c/0"]}
    assert read_trained_prompts(path) == {1: [("rollout-0", 0, "p7")],
                                          2: [("rollout-1", 0, "p4")]}


def test_a_ledger_without_prompts_reads_as_none(tmp_path):
    path = tmp_path / "trained_ids.jsonl"
    path.write_text(json.dumps({"step": 1, "trajectory_ids": ["a"]}) + "\n")
    assert read_trained_prompts(path) == {1: []}


def test_epoch_is_sent_with_the_begin():
    traj = trajectory_pb2.Trajectory(trajectory_id="g/0", group_id="g", group_size=1,
                                     prompt_token_ids=[1, 2], worker_id="rollout-1",
                                     prompt_id="p9", epoch=3)
    begin = trajectory_requests(traj)[0].begin
    assert isinstance(begin, store_pb2.TrajectoryBegin)
    assert (begin.worker_id, begin.prompt_id, begin.epoch) == ("rollout-1", "p9", 3)
