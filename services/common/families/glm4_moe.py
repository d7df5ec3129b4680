"""GLM-4.5/4.6/4.7: DeepSeek-V3's router, GQA with partial rotary and QKV bias (megatron:
trainer.megatron.family_glm4_moe)."""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, grouped
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers Glm4MoeConfig of the tiny model."""
    from transformers import Glm4MoeConfig

    # no MTP layer (transformers' default config has one; the trainer refuses MTP without drop_mtp)
    extra: dict[str, Any] = {"head_dim": cfg.head_dim, "partial_rotary_factor": 0.5,
                             "num_nextn_predict_layers": 0}
    return Glm4MoeConfig(**common(cfg), **grouped(cfg), **extra, attention_bias=True,
                         use_qk_norm=False)


FAMILY = Family(
    name="glm4_moe", rank=5, tiny_config=tiny_config,
    hf_routers={"Glm4MoeTopkRouter": "grouped_sigmoid"},
    engine_router_dtype=("fp32", "vLLM 0.30 Glm4MoE: the gate is an fp32 nn.Linear on fp32 "
                         "hidden states"),
    megatron_arch="trainer.megatron.family_glm4_moe:glm4_moe_arch")
