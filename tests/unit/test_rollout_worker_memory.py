"""The rollout worker holds a finished sample's routing encoded, not as the engine returned it
(issue 54): each trajectory is checked and encoded as soon as its sample ends and the engine's
arrays are dropped then, while the group's other samples still run; the group is still sent
whole (the store only hands out complete groups), with each sample's reward and exact rows."""

from __future__ import annotations

import asyncio
import weakref

import numpy as np

from services.common.wire import routing_from_proto
from services.rollout.dataset import PromptRecord
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
