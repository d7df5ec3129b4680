"""Qwen3-MoE (the default family): softmax top-k, renormalised, per-head QK-norm.

The base layout every other family is described against (megatron: the default FamilyArch). Its
tiny model is `services.common.tiny_moe` (seeded, the character tokenizer); the planner knows
Qwen3-30B-A3B and the tiny model by name.
"""

from __future__ import annotations

from services.common import tiny_moe
from services.common.families._base import Family, replicated_gate
from services.common.families._shape import ConfigKeys, ModelShape, decoder, gqa, sparse_step_moe

# Qwen/Qwen3-30B-A3B config.json (the keys trainer/megatron/hf_mapping.py and the planner read).
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960,
}


def tiny_moe_config() -> dict:
    """The HF config keys of `r3flow model tiny-moe` with its default sizes."""
    c = tiny_moe.TinyMoeConfig()
    return {"model_type": "qwen3_moe", "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "moe_intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "num_experts": c.num_experts, "num_experts_per_tok": c.top_k,
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(c.first_k_dense)),
            "vocab_size": tiny_moe.vocab_size(), "tie_word_embeddings": False}



def shape(k: ConfigKeys) -> ModelShape:
    """Qwen3-MoE's config.json: MoE layers by `decoder_sparse_step` / `mlp_only_layers`,
    `num_experts` of `moe_intermediate_size`, per-head QK-norm."""
    bias = k.flag("attention_bias")
    return ModelShape(**decoder(k), moe_layer_ids=sparse_step_moe(k),
                      attention=gqa(k, qkv_bias=bias, out_bias=bias, qk_norm="head"),
                      # transformers 5's Qwen3MoeConfig saves num_experts as num_local_experts
                      experts=k.num_of("num_experts", "num_local_experts"),
                      moe_ffn=k.num("moe_intermediate_size"),
                      dense_ffn=k.num("intermediate_size", 0))


FAMILY = Family(
    name="qwen3_moe", rank=0, tiny_config=tiny_moe.hf_config,
    hf_routers={"Qwen3MoeTopKRouter": "softmax_topk"},
    engine_router_dtype=replicated_gate("Qwen3MoeSparseMoeBlock"),
    megatron_arch="trainer.megatron.family_basic:qwen3_moe_arch", shape=shape,
    planner_models={"Qwen3-30B-A3B": lambda: dict(QWEN3_30B_A3B), "tiny-moe": tiny_moe_config},
    build=tiny_moe.build_tiny_moe)
