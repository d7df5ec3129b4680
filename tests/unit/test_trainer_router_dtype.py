"""model.router_dtype: `auto` (the default) resolves to what the rollout engine computes router
logits in for the model family, at model build, and the named 30B run uses it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trainer.config import TrainerConfig
from trainer.megatron.config import ModelConfig
from trainer.megatron.model import resolve_router_dtype

ROOT = Path(__file__).resolve().parents[2]


def test_auto_is_the_default_and_resolves_to_the_engines_dtype():
    assert ModelConfig().router_dtype == "auto"
    # vLLM 0.30's Qwen3-MoE gate is a ReplicatedLinear in the model dtype
    assert resolve_router_dtype(ModelConfig(dtype="bf16"), "qwen3_moe").router_dtype == "native"
    assert resolve_router_dtype(ModelConfig(router_dtype="fp32"), "qwen3_moe").router_dtype == \
        "fp32"  # an explicit choice is kept
    with pytest.raises(ValueError, match=r"model\.router_dtype"):
        resolve_router_dtype(ModelConfig(), "some_other_moe")


def test_named_qwen3_30b_run_routes_in_the_engines_dtype():
    docs = yaml.safe_load_all((ROOT / "k8s/qwen3-30b-a3b-grpo-r3.yaml").read_text())
    cm = next(d for d in docs if d and d["kind"] == "ConfigMap")
    cfg = TrainerConfig.model_validate(yaml.safe_load(cm["data"]["train.yaml"]))
    assert resolve_router_dtype(cfg.model, "qwen3_moe").router_dtype == "native"
