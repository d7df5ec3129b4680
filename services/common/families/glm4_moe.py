"""GLM-4.5/4.6/4.7: DeepSeek-V3's router, GQA with partial rotary and QKV bias (megatron:
trainer.megatron.family_glm4_moe)."""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, grouped
from services.common.families._shape import ConfigKeys, ModelShape, decoder, dense_first_moe, gqa
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers Glm4MoeConfig of the tiny model."""
    from transformers import Glm4MoeConfig

    # no MTP layer (transformers' default config has one; the trainer refuses MTP without drop_mtp)
    extra: dict[str, Any] = {"head_dim": cfg.head_dim, "partial_rotary_factor": 0.5,
                             "num_nextn_predict_layers": 0}
    return Glm4MoeConfig(**common(cfg), **grouped(cfg), **extra, attention_bias=True,
                         use_qk_norm=False)



def shape(k: ConfigKeys) -> ModelShape:
    """GLM-4.5's config.json: dense below `first_k_dense_replace`, `n_routed_experts` and
    `n_shared_experts` of `moe_intermediate_size`, QKV bias (`attention_bias`; the output
    projection has none), per-head QK-norm only with `use_qk_norm`; the MTP layers
    (`num_nextn_predict_layers`) are not counted (the trainer drops them). Z.ai's published
    active parameters count neither embedding table."""
    return ModelShape(**decoder(k), moe_layer_ids=dense_first_moe(k),
                      attention=gqa(k, qkv_bias=k.flag("attention_bias"),
                                    qk_norm="head" if k.flag("use_qk_norm") else "none"),
                      experts=k.num("n_routed_experts"), moe_ffn=k.num("moe_intermediate_size"),
                      dense_ffn=k.num("intermediate_size"),
                      shared_ffn=k.num("n_shared_experts", 0) * k.num("moe_intermediate_size"),
                      active_embeddings=())


FAMILY = Family(
    name="glm4_moe", rank=5, tiny_config=tiny_config,
    hf_routers={"Glm4MoeTopkRouter": "grouped_sigmoid"},
    engine_router_dtype=("fp32", "vLLM 0.30 Glm4MoE: the gate is an fp32 nn.Linear on fp32 "
                         "hidden states"),
    megatron_arch="trainer.megatron.family_glm4_moe:glm4_moe_arch", shape=shape)
