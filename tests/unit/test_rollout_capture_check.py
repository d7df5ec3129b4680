"""The rollout engine's check of its routing capture (services/rollout/capture_check.py), at
start and after each weight load: captured rows that pass the routing checks let the worker
serve; all-zero rows (vLLM-CPU with graphs compiled) refuse it with one line naming
engine.enforce_eager. After a load, the worker stops as on a dead engine: no new prompt, every
started group ok, failed or abandoned, the line as its fatal cause."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.rollout.capture_check import CHECK_TOKENS, RoutingCaptureError, check_capture
from services.rollout.config import SamplingConfig
from services.rollout.worker import RolloutWorker
from tests.support.fake_rollout import FakeEngine, LoadingEngine, endless_worker


def _check(engine: FakeEngine) -> None:
    asyncio.run(check_capture(engine, SamplingConfig(max_tokens=4096), [1, 2, 3], seed=0))


def test_a_capturing_engine_passes():
    _check(FakeEngine("good"))


@pytest.mark.parametrize("eager", [False, True])
def test_all_zero_rows_refuse_to_serve_naming_enforce_eager(eager):
    with pytest.raises(RoutingCaptureError) as err:
        _check(FakeEngine("zeros", enforce_eager=eager))
    line = str(err.value)
    assert "\n" not in line and "engine.enforce_eager" in line
    assert ("set engine.enforce_eager: true" in line) is not eager


@pytest.mark.parametrize("eager", [False, True])
def test_no_routing_at_all_names_the_capture_flag_not_graphs(eager):
    # an engine built without enable_return_routed_experts (measured on H200, vLLM 0.24.0,
    # through RolloutEngine: tests/bench/bench_vllm_gpu.py); graphs are not the cause
    with pytest.raises(RoutingCaptureError) as err:
        _check(FakeEngine("none", enforce_eager=eager))
    line = str(err.value)
    assert "\n" not in line and "no routing captured" in line
    assert "enable_return_routed_experts" in line and "set engine.enforce_eager" not in line


def test_the_check_is_short():
    seen = []

    class Counting(FakeEngine):
        async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
            seen.append(params.max_tokens)
            return await super().generate(request_id, prompt_ids, params)
    _check(Counting("good"))
    assert seen == [CHECK_TOKENS]


def _run_with_a_load(after: str) -> tuple[RolloutWorker, object]:
    """A worker over endless prompts; weights loaded once 3 groups were sent; the run ends on
    its own (a refusal) or by a stop request once 6 more groups were sent."""
    worker, records = endless_worker(LoadingEngine(after))
    worker.capture_check.probe_ids = [1, 2, 3]  # set by serve once the start check passed

    async def until_sent(run: asyncio.Task, count: int) -> None:
        # Polls: a MemorySink offers nothing to wait on, and the fake engine's calls take
        # 10 ms each on purpose, so groups overlap the load. A run that ended (a fatal error)
        # ends the wait: its summary names the cause (a wait on it alone hung to the 900 s
        # CI timeout when the fake engine lacked an attribute the worker reads)
        while not run.done() and len(worker.sink.trajectories) < count:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)

    async def main():  # noqa: ANN202
        run = asyncio.create_task(worker.run(records, stop_grace_s=5.0))
        await until_sent(run, 6)
        if not run.done():
            await worker.update_weights_from_tensors({"w": 0})
            await worker.capture_check.wait()
            await until_sent(run, len(worker.sink.trajectories) + 12)  # type: ignore[union-attr]
        worker.request_stop()
        return await asyncio.wait_for(run, 30)
    return worker, asyncio.run(main())


def test_the_check_after_a_load_passes_and_the_worker_serves_on(caplog):
    caplog.set_level(logging.INFO, "services.rollout.capture_check")
    worker, summary = _run_with_a_load("good")
    assert worker.refusal is None and summary.fatal is None, summary
    assert "routing capture check after loading v1 passed" in caplog.text


def test_bad_rows_after_a_load_refuse_to_serve_with_accounting(caplog):
    worker, summary = _run_with_a_load("zeros")
    line = summary.fatal
    assert line == worker.refusal and "\n" not in line, line
    assert "check after loading weights v1" in line and "set engine.enforce_eager: true" in line
    assert summary.stopped_early and summary.groups_in_flight == 0, summary
    assert summary.groups_started == (summary.groups_ok + summary.groups_failed
                                      + summary.groups_abandoned), summary
    assert summary.trajectories_sent == 2 * summary.groups_ok, summary
    critical = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert critical == [f"rollout {worker.cfg.worker_id} refuses to serve: {line}"], critical
