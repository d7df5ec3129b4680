"""A rollout worker whose group, engine watch, capture check or store watch fails unexpectedly
(a bug, not a bad request) stops: `run` returns within a bounded wait (the prompts are endless,
so only the failure can end it), with the cause in one line as its fatal summary (the process
then exits 3), and every started group ok, failed or abandoned."""

from __future__ import annotations

import asyncio
import threading

from services.rollout import app
from services.rollout import worker as worker_module
from services.rollout.report import WorkerSummary
from services.rollout.worker import RolloutWorker
from tests.support.fake_rollout import LoadingEngine, endless_worker

BOUND_S = 10.0  # far above what a stop takes (FATAL_GRACE_S is 5 s; these take ~0.1 s)


def _run(worker: RolloutWorker, records, beside=None) -> WorkerSummary:  # noqa: ANN001
    """`worker.run` (and `beside(loop)` next to it) bounded by BOUND_S."""
    async def main() -> WorkerSummary:
        run = asyncio.create_task(worker.run(records, stop_grace_s=30.0))
        if beside is not None:
            beside(asyncio.get_running_loop())
        return await asyncio.wait_for(run, BOUND_S)
    return asyncio.run(main())


def _stopped(summary: WorkerSummary) -> str:
    """The fatal line of a worker that stopped with complete accounting."""
    assert summary.fatal is not None and "\n" not in summary.fatal, summary
    assert summary.stopped_early and summary.groups_in_flight == 0, summary
    assert summary.groups_started == (summary.groups_ok + summary.groups_failed
                                      + summary.groups_abandoned), summary
    return summary.fatal


class Broken(LoadingEngine):
    """Raises `error` from its `failing` call once `calls_ok` calls of it succeeded."""

    def __init__(self, failing: str, error: Exception, calls_ok: int = 4) -> None:
        super().__init__("good")
        self.failing, self.error, self.calls_ok = failing, error, calls_ok

    def _maybe_raise(self, call: str) -> None:
        if call == self.failing:
            self.calls_ok -= 1
            if self.calls_ok < 0:
                raise self.error

    async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
        self._maybe_raise("generate" if "routing-capture" not in request_id else "check")
        return await super().generate(request_id, prompt_ids, params)

    def dead_reason(self) -> str | None:
        self._maybe_raise("dead_reason")
        return None


def test_an_unexpected_group_error_ends_run_with_its_cause():
    worker, records = endless_worker(Broken("generate", RuntimeError("boom")))
    line = _stopped(_run(worker, records))
    assert line.startswith("RuntimeError in group ") and line.endswith(": boom"), line


def test_an_engine_watch_that_raises_ends_run(monkeypatch):
    monkeypatch.setattr(worker_module, "ENGINE_WATCH_S", 0.01)
    worker, records = endless_worker(Broken("dead_reason", KeyError("pids"), calls_ok=2))
    assert _stopped(_run(worker, records)) == "KeyError in the engine watch: 'pids'"


def test_a_capture_check_that_raises_after_a_load_ends_run():
    worker, records = endless_worker(Broken("check", TypeError("bad probe"), calls_ok=0))
    worker.capture_check.probe_ids = [1, 2, 3]  # set by serve once the start check passed

    def load(loop: asyncio.AbstractEventLoop) -> None:
        loop.create_task(worker.update_weights_from_tensors({"w": 0}))
    line = _stopped(_run(worker, records, load))
    assert line == worker.refusal == ("TypeError in the routing capture check after loading "
                                      "v1: bad probe"), line


def _watch_store_gone(client, worker, loop) -> None:  # noqa: ANN001
    raise ConnectionError("store unreachable after 8 retries")


def test_a_store_watch_that_dies_ends_run():
    worker, records = endless_worker(LoadingEngine("good"))

    def watch(loop: asyncio.AbstractEventLoop) -> None:
        threading.Thread(target=app._guarded, daemon=True, args=(
            _watch_store_gone, threading.Event(), None, worker, loop)).start()
    line = _stopped(_run(worker, records, watch))
    assert line == ("_watch_store_gone stopped: ConnectionError: store unreachable after 8 "
                    "retries"), line


def test_a_store_watch_ending_at_exit_is_not_a_failure():
    worker, _ = endless_worker(LoadingEngine("good"))
    closing = threading.Event()
    closing.set()  # run() returned: the client is being closed

    async def main() -> None:
        t = threading.Thread(target=app._guarded, args=(
            _watch_store_gone, closing, None, worker, asyncio.get_running_loop()))
        t.start()
        await asyncio.to_thread(t.join)
        await asyncio.sleep(0)  # a fail() scheduled on the loop would have run by now
    asyncio.run(main())
    assert worker.refusal is None
