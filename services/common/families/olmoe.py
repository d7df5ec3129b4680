"""OLMoE: softmax top-k without renormalisation, QK-norm over the whole projection (megatron:
trainer.megatron.family_olmoe), every layer MoE (the experts' width is `intermediate_size`)."""

from __future__ import annotations

from services.common.families._base import Family, common, no_dense, replicated_gate
from services.common.families._shape import ConfigKeys, ModelShape, decoder, every_layer_moe, gqa
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers OlmoeConfig of the tiny model."""
    from transformers import OlmoeConfig

    no_dense(cfg, "olmoe")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("head_dim: olmoe derives it as hidden_size / num_attention_heads")
    return OlmoeConfig(**common(cfg), num_experts=cfg.num_experts,
                       intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=False,
                       router_aux_loss_coef=0.0)



def shape(k: ConfigKeys) -> ModelShape:
    """OLMoE's config.json: every layer MoE, `num_experts` of `intermediate_size`, QK-norm over
    the whole q and k projections."""
    bias = k.flag("attention_bias")
    return ModelShape(**decoder(k), moe_layer_ids=every_layer_moe(k),
                      attention=gqa(k, qkv_bias=bias, out_bias=bias, qk_norm="full"),
                      experts=k.num("num_experts"), moe_ffn=k.num("intermediate_size"),
                      dense_ffn=0)


FAMILY = Family(
    name="olmoe", rank=3, tiny_config=tiny_config,
    hf_routers={"OlmoeTopKRouter": "softmax_topk"},
    engine_router_dtype=replicated_gate("OlmoeMoE"),
    megatron_arch="trainer.megatron.family_olmoe:olmoe_arch", shape=shape)
