"""Mixtral: softmax over the top-k logits (always renormalised), no shared expert, every layer MoE
(the experts' width is `intermediate_size`); its sliding-window attention is not mapped."""

from __future__ import annotations

from services.common.families._base import Family, common, no_dense, replicated_gate
from services.common.families._shape import ConfigKeys, ModelShape, decoder, every_layer_moe, gqa
from services.common.tiny_moe import TinyMoeConfig

# mistralai/Mixtral-8x7B-v0.1 config.json (https://huggingface.co/mistralai/Mixtral-8x7B-v0.1):
# the planner knows it by name (`r3flow plan --model Mixtral-8x7B`, r3flow.io/plan-model)
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None,
    "router_aux_loss_coef": 0.02,
}


def tiny_config(cfg: TinyMoeConfig):
    """The transformers MixtralConfig of the tiny model."""
    from transformers import MixtralConfig

    no_dense(cfg, "mixtral")
    return MixtralConfig(**common(cfg), head_dim=cfg.head_dim,
                         num_local_experts=cfg.num_experts,
                         intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=0.0)



def shape(k: ConfigKeys) -> ModelShape:
    """Mixtral's config.json: every layer MoE, `num_local_experts` of `intermediate_size`."""
    return ModelShape(**decoder(k), moe_layer_ids=every_layer_moe(k), attention=gqa(k),
                      experts=k.num("num_local_experts"), moe_ffn=k.num("intermediate_size"),
                      dense_ffn=0)


FAMILY = Family(
    name="mixtral", rank=2, tiny_config=tiny_config,
    hf_routers={"MixtralTopKRouter": "renormalised_softmax"},
    engine_router_dtype=replicated_gate("MixtralMoE"),
    megatron_arch="trainer.megatron.family_basic:mixtral_arch", shape=shape,
    planner_models={"Mixtral-8x7B": lambda: dict(MIXTRAL_8X7B)})
