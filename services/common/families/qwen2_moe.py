"""Qwen2-MoE: softmax top-k without renormalisation, a shared expert with a sigmoid gate."""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, dense_first, replicated_gate
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers Qwen2MoeConfig of the tiny model."""
    from transformers import Qwen2MoeConfig

    dense_first(cfg)
    # head_dim (and the fields below for other families) go through **kwargs in transformers 5
    extra: dict[str, Any] = {"head_dim": cfg.head_dim}
    return Qwen2MoeConfig(**common(cfg), **extra, num_experts=cfg.num_experts,
                          moe_intermediate_size=cfg.moe_intermediate_size,
                          intermediate_size=cfg.intermediate_size,
                          shared_expert_intermediate_size=cfg.moe_intermediate_size,
                          decoder_sparse_step=1, mlp_only_layers=list(range(cfg.first_k_dense)),
                          norm_topk_prob=False, router_aux_loss_coef=0.0)


FAMILY = Family(
    name="qwen2_moe", rank=1, tiny_config=tiny_config,
    hf_routers={"Qwen2MoeTopKRouter": "softmax_topk"},
    engine_router_dtype=replicated_gate("Qwen2MoeSparseMoeBlock"),
    megatron_arch="trainer.megatron.family_basic:qwen2_moe_arch")
