"""Faults on the `r3flow local` topology, one at a time and then all at once; afterwards every
trajectory is trained on exactly once or dropped with a counted reason (tests/faults/fault_harness.py).

One run (module fixture) carries the whole schedule, so the suite costs one local run:
store SIGKILL, redis-server SIGKILL + restart (AOF), store frozen (SIGSTOP) for 30 s, trainer
SIGKILL mid-step (resumes from its checkpoint), rollout SIGKILL mid-generation, then all four
kills at once. After each single fault the trainer must take a new step (recovery); after the
combined one the worker's last incarnation rolls out LAST_PROMPTS prompts and the run ends.
Figures: <run>/faults.json, copied to bench-results/faults.json (RELIABILITY.md "## Faults").
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from fault_harness import FaultRun, fault_config

from trainer.loop.ledger import read_trained_ids

pytestmark = [pytest.mark.faults]
ROOT = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 60  # per worker incarnation: enough to outlive the faults scheduled on it
LAST_PROMPTS = 12  # the incarnation started after the combined fault, to the end of the run


@pytest.fixture(scope="module")
def result() -> dict:
    # Not tmp_path_factory: a concurrent pytest session rotates those folders away mid-run.
    runs = Path(tempfile.mkdtemp(prefix="r3flow-faults-"))
    fr = FaultRun(fault_config(runs, NUM_PROMPTS))
    try:
        fr.start()
        fr.wait_steps(1)
        for inject in (fr.kill_store, fr.restart_redis, fr.freeze_store, fr.kill_trainer,
                       fr.kill_rollout):
            inject()
            fr.wait_steps(1)
        fr.all_at_once(LAST_PROMPTS)
        out = fr.finish()
    finally:
        fr.close()
    dest = ROOT / "bench-results" / "faults.json"
    dest.parent.mkdir(exist_ok=True)
    shutil.copy(fr.run.dir / "faults.json", dest)
    shutil.rmtree(runs)  # kept when the run failed, for its logs    print(json.dumps({k: v for k, v in out.items() if k != "worker_summaries"}, indent=1))
    return out


def test_every_fault_kind_was_injected(result):
    kinds = Counter(f["kind"] for f in result["faults"])
    assert kinds == {"rollout_sigkill": 1, "store_sigkill": 1, "redis_restart": 2,
                     "store_unreachable": 1, "trainer_sigkill": 1, "combined": 1}, kinds
    kills = [f for f in result["faults"] if f["kind"] in ("rollout_sigkill", "combined")]
    assert all(f["groups_in_flight"] > 0 for f in kills), kills  # killed mid-generation
    assert result["trainer_exit"] == 0


def test_zero_lost(result):
    """produced = trained + dropped (by reason, dead-lettered included) + unused at end + the
    groups a killed worker left incomplete; those can only come from groups the workers never
    finished."""
    a = result["accounting"]
    w = a["workers"]
    assert a["balanced"], a
    assert a["trained"] > 0 and a["produced"] > a["trained"], a
    rest = a["produced"] - a["trained"] - sum(a["dropped"].values()) - a["unused_at_end"]
    assert rest == a["in_incomplete_groups"], a
    assert 0 <= rest <= w["killed_in_flight"] + w["abandoned"], a
    assert w["sent"] <= a["produced"] <= w["sent"] + w["killed_in_flight"] + w["abandoned"], a
    # dead-lettered groups (redelivered past the store's max_redeliveries) are counted here,
    # by the store, as neither trained nor lost
    assert set(a["dropped"]) <= {"stale", "aborted", "dead_letter"}, a["dropped"]


def test_zero_trained_twice(result):
    """From the trainer's side, across its restarts: every trained trajectory id is unique, and
    the count equals what the store saw acked."""
    a = result["accounting"]
    assert result["trained_ids"] == result["trained_unique"], result
    assert result["trained_ids"] == a["trained"], (result["trained_ids"], a)


def test_every_worker_incarnation_reported(result):
    sums = result["worker_summaries"]
    assert len(sums) == 3  # first, after the rollout kill, after the combined kill
    assert sorted(s["final"] for s in sums) == [False, False, True]  # 2 killed, 1 stopped
    # The middle incarnation lives only between two kills: on a loaded machine it may be
    # killed before it finishes a group, so only the other two must have sent some.
    assert sum(s["trajectories_sent"] > 0 for s in sums) >= 2, sums
    assert all(s["trajectories_sent"] > 0 for s in sums if s["final"]), sums
    for s in sums:
        assert s["groups_ok"] + s["groups_failed"] + s["groups_abandoned"] <= s["groups_started"], s


def test_trained_ids_reader_drops_rolled_back_steps(tmp_path):
    path = tmp_path / "trained_ids.jsonl"
    lines = [{"resumed_at": 0}, {"step": 1, "trajectory_ids": ["a"]},
             {"step": 2, "trajectory_ids": ["b"]}, {"resumed_at": 1},
             {"step": 2, "trajectory_ids": ["b", "c"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n" + '{"step": 3, "traj')
    path.write_text(path.read_text() + "\n" + json.dumps({"resumed_at": 2}) + "\n")
    assert read_trained_ids(path) == {1: ["a"], 2: ["b", "c"]}
