"""A stand-in for the rollout engine (RolloutEngine's surface the worker uses) that generates
tokens and routing rows without vLLM, and a worker over it with endless prompts; shared by the
routing-capture-check and worker-failure tests."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
from prometheus_client import CollectorRegistry

from services.common.metrics import create_metrics
from services.common.tiny_moe import build_tokenizer
from services.rollout.config import RolloutConfig
from services.rollout.dataset import PromptRecord
from services.rollout.segments import CallOutput
from services.rollout.sink import MemorySink
from services.rollout.worker import RolloutWorker

LAYERS, TOP_K, EXPERTS = 2, 2, 4


class FakeEngine:
    """Generates `max_tokens` tokens with rows of the given kind (good, all-zero, none)."""

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


class LoadingEngine(FakeEngine):
    """Captures good rows until a weight load, then the rows that `after` names."""

    def __init__(self, after: str) -> None:
        super().__init__("good")
        self.after = after
        self.metrics = create_metrics(CollectorRegistry(), "rollout")
        self.policy_version = 0
        self.run_id = ""  # weights from disk, no training run yet (RolloutEngine.run_id)

    def dead_reason(self) -> str | None:
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


def endless_worker(engine: FakeEngine) -> tuple[RolloutWorker, list[PromptRecord]]:
    """A worker over `engine` with a memory sink and endless prompts (epochs 0: only a stop
    or a fatal error ends its run), and its records."""
    cfg = RolloutConfig.model_validate({
        "engine": {"model": "unused", "max_model_len": 64}, "dataset": "unused", "epochs": 0,
        "concurrency": 4, "sampling": {"n": 2, "max_tokens": 4}})
    worker = RolloutWorker(cfg, engine, MemorySink(), build_tokenizer())  # type: ignore[arg-type]
    records = [PromptRecord(f"p{i}", "0", prompt_token_ids=(4, 5, 6 + i)) for i in range(8)]
    return worker, records
