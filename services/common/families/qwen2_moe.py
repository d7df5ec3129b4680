"""Qwen2-MoE: softmax top-k without renormalisation, a shared expert with a sigmoid gate."""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, dense_first, replicated_gate
from services.common.families._shape import ConfigKeys, ModelShape, decoder, gqa, sparse_step_moe
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



def shape(k: ConfigKeys) -> ModelShape:
    """Qwen2-MoE's config.json (Qwen1.5-MoE): Qwen3-MoE's layer keys, QKV bias (`qkv_bias`,
    on by default), no QK-norm, a shared expert of `shared_expert_intermediate_size` with its
    sigmoid gate."""
    shared = k.num("shared_expert_intermediate_size", 0)
    return ModelShape(**decoder(k), moe_layer_ids=sparse_step_moe(k),
                      attention=gqa(k, qkv_bias=k.flag("qkv_bias", True)),
                      experts=k.num("num_experts"), moe_ffn=k.num("moe_intermediate_size"),
                      dense_ffn=k.num("intermediate_size", 0), shared_ffn=shared,
                      shared_gate=shared > 0)


FAMILY = Family(
    name="qwen2_moe", rank=1, tiny_config=tiny_config,
    hf_routers={"Qwen2MoeTopKRouter": "softmax_topk"},
    engine_router_dtype=replicated_gate("Qwen2MoeSparseMoeBlock"),
    megatron_arch="trainer.megatron.family_basic:qwen2_moe_arch", shape=shape)
