"""The rollout worker holds a finished sample's routing encoded, not as the engine returned it
(issue 54): each trajectory is checked and encoded as soon as its sample ends and the engine's
arrays are dropped then, while the group's other samples still run; the group is still sent
whole (the store only hands out complete groups), with each sample's reward and exact rows."""

from __future__ import annotations

import asyncio
import weakref
from pathlib import Path

import numpy as np

from services.common.wire import routing_from_proto
from services.rollout.dataset import PromptRecord
from services.rollout.report import WorkerSummary
from services.rollout.sink import MemorySink
from tests.support.fake_rollout import EXPERTS, TOP_K, LoadingEngine, endless_worker


class Gated(LoadingEngine):
    """Distinct routing per request; the calls of sample 1 (`<group>-1#<call>`) wait for
    `release`. Keeps a weak reference to each array it returned, and a copy of it, by
    trajectory id."""

    def __init__(self) -> None:
        super().__init__("good")
        self.release = asyncio.Event()
        self.arrays: dict[str, weakref.ref] = {}
        self.copies: dict[str, np.ndarray] = {}

    async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
        tid = request_id.split("#")[0]
        if tid.endswith("-1"):
            await self.release.wait()
        out = await super().generate(request_id, prompt_ids, params)
        rng = np.random.default_rng(len(self.arrays))
        keys = rng.random((*out.routing_TLK.shape[:2], EXPERTS))
        out.routing_TLK = np.argsort(keys, axis=-1)[..., :TOP_K].astype(np.int32)
        self.arrays[tid] = weakref.ref(out.routing_TLK)
        self.copies[tid] = out.routing_TLK.copy()
        return out


def _rows(traj) -> np.ndarray:  # noqa: ANN001
    return np.concatenate([routing_from_proto(c) for s in traj.segments for c in s.routing])


def test_a_sample_is_encoded_and_its_engine_routing_dropped_as_it_ends():
    engine = Gated()
    worker, _ = endless_worker(engine)
    scored = asyncio.Event()
    reward_of = worker.reward_of

    async def first_scored(res, *args, **kwargs):  # noqa: ANN001, ANN202
        if res.calls[0].request_id.startswith("g-0#"):
            scored.set()
        return await reward_of(res, *args, **kwargs)

    worker.reward_of = first_scored  # type: ignore[method-assign]

    async def main():  # noqa: ANN202
        task = asyncio.create_task(worker.run_group("g", PromptRecord("p", "0", prompt_token_ids=(
            4, 5, 6)), seed=1))
        await asyncio.wait_for(scored.wait(), 5)
        # sample 0 is encoded and vLLM's array gone while sample 1 has not even returned
        assert engine.arrays["g-0"]() is None and "g-1" not in engine.arrays
        engine.release.set()
        return await asyncio.wait_for(task, 5)

    group = asyncio.run(main())
    assert [t.trajectory_id for t in group.trajectories] == ["g-0", "g-1"]
    for res, traj in zip(group.results, group.trajectories, strict=True):
        rid = traj.trajectory_id
        assert engine.arrays[rid]() is None and res.calls[0].routing_TLK is None
        assert all(s.rows_TLK is None for s in res.state.segments)
        assert np.array_equal(_rows(traj), np.sort(engine.copies[rid], axis=-1))  # canonical
        assert res.reward is not None and traj.reward == res.reward
        assert dict(traj.reward_components) == res.reward_components
    assert not np.array_equal(engine.copies["g-0"], engine.copies["g-1"])


def test_engine_routing_is_kept_when_asked():
    engine = Gated()
    engine.release.set()
    worker, _ = endless_worker(engine)
    worker.keep_engine_routing = True
    group = asyncio.run(worker.run_group("g", PromptRecord("p", "0", prompt_token_ids=(4, 5)),
                                         seed=1))
    for res, traj in zip(group.results, group.trajectories, strict=True):
        rid = traj.trajectory_id
        assert res.calls[0].routing_TLK is engine.arrays[rid]()
        assert np.array_equal(res.calls[0].routing_TLK, engine.copies[rid])


class FilesAtSend(MemorySink):
    """A memory sink noting the spill files present in `directory` when a group is sent."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory, self.files_at_send = directory, []

    async def send_group(self, trajs, spill=None):  # noqa: ANN001, ANN201
        self.files_at_send.append(sorted(p.name for p in self.directory.iterdir()))
        await super().send_group(trajs, spill)


def _spilling_worker(engine: Gated, directory: Path, threshold: int = 0):  # noqa: ANN202
    """A worker spilling into `directory`, and an event set once sample 0 was kept."""
    worker, _ = endless_worker(engine)
    worker.cfg = worker.cfg.model_copy(update={"spill_routing_bytes": threshold,
                                               "spill_routing_dir": str(directory)})
    worker.sink = FilesAtSend(directory)
    first_kept = asyncio.Event()
    reward_of = worker.reward_of

    async def first_scored(res, *args, **kwargs):  # noqa: ANN001, ANN202
        out = await reward_of(res, *args, **kwargs)
        if res.calls[0].request_id.split("#")[0].endswith("-0"):
            asyncio.get_running_loop().call_soon(first_kept.set)  # after keep() of sample 0
        return out

    worker.reward_of = first_scored  # type: ignore[method-assign]
    sample, worker.spills = worker._sample, []  # type: ignore[attr-defined]

    async def noted(*args):  # noqa: ANN002, ANN202 (held here: no garbage collector cleans up)
        worker.spills.append(args[-1])  # type: ignore[attr-defined]
        return await sample(*args)

    worker._sample = noted  # type: ignore[method-assign]
    return worker, first_kept


def test_a_spilled_group_is_sent_with_its_exact_rows_and_its_file_removed(tmp_path: Path):
    engine = Gated()
    worker, spilled = _spilling_worker(engine, tmp_path)
    summary = WorkerSummary()

    async def main() -> None:
        task = asyncio.create_task(worker._group_task(0, 0, PromptRecord(
            "p", "0", prompt_token_ids=(4, 5, 6)), summary))
        await asyncio.wait_for(spilled.wait(), 5)
        assert len(list(tmp_path.iterdir())) == 1  # sample 0 on disk while sample 1 runs
        engine.release.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert summary.groups_ok == 1 and list(tmp_path.iterdir()) == []
    assert len(worker.sink.files_at_send) == 1 and len(worker.sink.files_at_send[0]) == 1
    sent = worker.sink.trajectories
    assert len(sent) == 2
    for traj in sent:  # the routing read back from the file: the engine's rows
        assert np.array_equal(_rows(traj), np.sort(engine.copies[traj.trajectory_id], axis=-1))


def test_a_spill_write_failure_fails_the_group_naming_the_knob(tmp_path: Path):
    engine = Gated()
    engine.release.set()
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    worker, _ = _spilling_worker(engine, not_a_dir)
    summary = WorkerSummary()
    asyncio.run(worker._group_task(0, 0, PromptRecord("p", "0", prompt_token_ids=(4, 5)),
                                   summary))
    assert summary.groups_failed == 1 and summary.groups_ok == 0
    assert worker.sink.trajectories == [] and worker.sink.files_at_send == []
    [line] = summary.errors
    assert "spill_routing_dir" in line and str(not_a_dir) in line and "\n" not in line


def test_a_cancelled_group_removes_its_spill_file(tmp_path: Path):
    engine = Gated()
    worker, spilled = _spilling_worker(engine, tmp_path)

    async def main() -> None:
        task = asyncio.create_task(worker.run_group("g", PromptRecord(
            "p", "0", prompt_token_ids=(4, 5, 6)), seed=1))
        await spilled.wait()  # sample 0 spilled; sample 1 waits on the gate
        assert len(list(tmp_path.iterdir())) == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(asyncio.wait_for(main(), 5))
    assert list(tmp_path.iterdir()) == [] and worker.sink.trajectories == []


def test_below_the_threshold_nothing_is_spilled(tmp_path: Path):
    engine = Gated()
    engine.release.set()
    worker, _ = _spilling_worker(engine, tmp_path, threshold=1 << 30)
    summary = WorkerSummary()
    asyncio.run(worker._group_task(0, 0, PromptRecord("p", "0", prompt_token_ids=(4, 5)),
                                   summary))
    assert summary.groups_ok == 1 and worker.sink.files_at_send == [[]]
    assert all(len(s.routing) for t in worker.sink.trajectories for s in t.segments)


def test_a_keep_that_runs_after_its_group_was_dropped_writes_nothing(tmp_path: Path):
    """The worker keeps a finished trajectory off its event loop (asyncio.to_thread); a group
    cancelled meanwhile closes its spill first: the late keep must not open a new file."""
    import numpy as np

    from services.rollout.spill import RoutingSpill
    from services.store.synthetic import build_trajectory, random_routing

    ids = random_routing(8 + 4 - 1, 2, 2, 8, np.random.default_rng(0))
    traj = build_trajectory("late", "g", 1, prompt_ids_TLK=ids[:8], response_ids_TLK=ids[8:],
                            segment_lengths=[4], num_experts=8)
    spill = RoutingSpill(0, str(tmp_path))
    spill.close()
    spill.keep(traj)
    assert list(tmp_path.iterdir()) == [] and spill.trajectories(["late"]) == []
    assert not spill.spilled()
