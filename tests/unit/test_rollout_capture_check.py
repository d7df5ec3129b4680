"""The rollout engine's start check of its routing capture (services/rollout/capture_check.py):
captured rows that pass the routing checks let the worker serve; all-zero rows (vLLM-CPU with
graphs compiled) refuse it with one line naming engine.enforce_eager."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from services.rollout.capture_check import CHECK_TOKENS, RoutingCaptureError, check_capture
from services.rollout.config import SamplingConfig
from services.rollout.segments import CallOutput

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
                          routing_TLK=ids if self.rows == "good" else np.zeros_like(ids),
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


def test_the_check_is_short():
    seen = []

    class Counting(FakeEngine):
        async def generate(self, request_id, prompt_ids, params):  # noqa: ANN001
            seen.append(params.max_tokens)
            return await super().generate(request_id, prompt_ids, params)
    _check(Counting("good"))
    assert seen == [CHECK_TOKENS]
