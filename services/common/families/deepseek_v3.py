"""DeepSeek-V3 (Moonlight, Kimi-K2): MLA, grouped sigmoid router, shared expert.

Megatron: trainer.megatron.family_deepseek_v3 (FamilyArch, MLA config, spec and weight mapping);
vLLM-CPU: services.rollout.mla_rope refuses MLA with plain RoPE (`mla`).
"""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, grouped
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers DeepseekV3Config of the tiny model."""
    from transformers import DeepseekV3Config

    d = cfg.head_dim
    # the real checkpoints' fields (vLLM picks the router by them); no MTP layers
    extra: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                             "num_nextn_predict_layers": 0}
    # YaRN as DeepSeek-V3 and Kimi-K2 ship it (mscale = mscale_all_dim = 1), over a quarter of
    # the context. Also what vLLM-CPU 0.30 needs: with plain rope its MLA goes through the CPU
    # rotary kernel, which mis-rotates MLA's 3-D q_pe/k_pe views (services.rollout.mla_rope).
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": cfg.max_position_embeddings // 4,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    # MLA has as many KV heads as query heads
    return DeepseekV3Config(**(common(cfg) | {"num_key_value_heads": cfg.num_attention_heads}),
                            **grouped(cfg), q_lora_rank=cfg.hidden_size // 2,
                            # vLLM-CPU 0.30's MLA kernels take only kv_lora_rank + rope dim = 576
                            kv_lora_rank=512, qk_rope_head_dim=64,
                            qk_nope_head_dim=d, v_head_dim=d, rope_parameters=yarn, **extra)


FAMILY = Family(
    name="deepseek_v3", rank=4, tiny_config=tiny_config,
    hf_routers={"DeepseekV3TopkRouter": "grouped_sigmoid"},
    engine_router_dtype=("native", "vLLM 0.30 DeepseekV2MoE: the gate is a GateLinear in the "
                         "model dtype (fp32 only with config moe_router_dtype float32, or on "
                         "CUDA kernels)"),
    megatron_arch="trainer.megatron.family_deepseek_v3:deepseek_v3_arch", mla=True)
