"""`engine.quantization: fp8` (vLLM's online FP8 against the bf16 trainer, issue 57): passed to
vLLM, refused in one line where the device cannot run it (vLLM-CPU, old GPUs), and the planner
counts the fp8 engine's weights."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.rollout.config import EngineConfig
from services.rollout.engine import quantization_refusal
from trainer.plan.layout import Arch
from trainer.plan.models import load_model_config
from trainer.plan.rollout import engine_weight_bytes, plan_rollout

QWEN = Arch.from_hf_config(load_model_config("Qwen3-30B-A3B"))


def test_fp8_is_refused_in_one_line_on_the_cpu_and_old_gpus():
    cpu = quantization_refusal("fp8", None)
    assert cpu is not None and "\n" not in cpu
    assert "engine.quantization: fp8" in cpu and "CPU" in cpu
    old = quantization_refusal("fp8", (7, 5))
    assert old is not None and "7.5" in old and "\n" not in old
    assert quantization_refusal("fp8", (9, 0)) is None  # H100 / H200
    assert quantization_refusal("none", None) is None


def test_only_known_quantizations_are_accepted():
    assert EngineConfig(model="m", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValidationError, match="quantization"):
        EngineConfig(model="m", quantization="int4")


def test_the_planner_counts_fp8_linears_at_one_byte():
    bf16, fp8 = engine_weight_bytes(QWEN), engine_weight_bytes(QWEN, "fp8")
    assert bf16 == QWEN.total_params() * 2
    # the experts are ~97% of Qwen3-30B-A3B: fp8 about halves the engine's weights
    assert 0.5 * bf16 < fp8 < 0.53 * bf16
    # the KV cache gets what fp8 frees: one GPU holds what bf16 needs two for
    assert plan_rollout(QWEN, 80, 0.85, 8192, 32).tp == 2
    assert plan_rollout(QWEN, 80, 0.85, 8192, 32, quantization="fp8").tp == 1


def test_a_fixed_kv_cache_reaches_vllm_only_when_set():
    """engine.kv_cache_memory_bytes: engines sharing one GPU skip vLLM's device-wide memory
    profile (issue 57: arms side by side on one H200)."""
    from services.rollout.engine import engine_kwargs

    fixed = engine_kwargs(EngineConfig(model="m", kv_cache_memory_bytes=2**30))
    assert fixed["kv_cache_memory_bytes"] == 2**30
    assert "kv_cache_memory_bytes" not in engine_kwargs(EngineConfig(model="m"))
    with pytest.raises(ValidationError, match="kv_cache_memory_bytes"):
        EngineConfig(model="m", kv_cache_memory_bytes=0)
