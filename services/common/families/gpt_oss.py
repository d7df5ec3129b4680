"""GPT-OSS: router with bias, softmax over the top-k, attention sinks, sliding/full layers.

What the family decides outside its megatron mapping (trainer.megatron.family_gpt_oss): the HF
backend trains it with eager attention (transformers has no sdpa for it) and unpacked
micro-batches (its masks ignore packed boundaries); vLLM-CPU runs it in bf16 only (its
attention-sink kernel takes bf16 sinks) and puts the sliding window on the even layers whatever
`layer_types` says (`check_engine_layout`); megatron's grouped expert module cannot run its
expert biases. Every layer is MoE (the experts' width is `intermediate_size`).
"""

from __future__ import annotations

from typing import Any

from services.common.families._base import Family, common, no_dense, replicated_gate
from services.common.families._shape import ConfigKeys, ModelShape, decoder, every_layer_moe, gqa
from services.common.tiny_moe import TinyMoeConfig


def tiny_config(cfg: TinyMoeConfig):
    """The transformers GptOssConfig of the tiny model."""
    from transformers import GptOssConfig

    no_dense(cfg, "gpt_oss")
    kinds = ["sliding_attention", "full_attention"]
    # rope stays GptOssConfig's YaRN: vLLM 0.30's GptOssAttention reads its factor unconditionally
    return GptOssConfig(**common(cfg), head_dim=cfg.head_dim, num_local_experts=cfg.num_experts,
                        intermediate_size=cfg.moe_intermediate_size, sliding_window=16,
                        layer_types=[kinds[i % 2] for i in range(cfg.num_layers)],
                        router_aux_loss_coef=0.0)


def check_engine_layout(hf_config: Any) -> None:
    """Refuse a config vLLM 0.30 would run differently from what it says (and from the trainer,
    which follows the config): GPT-OSS's sliding window goes on the even layers whatever
    `layer_types` says (vllm/model_executor/models/gpt_oss.py)."""
    types = getattr(hf_config, "layer_types", None)
    if types:
        engine = ["sliding_attention" if i % 2 == 0 else "full_attention"
                  for i in range(len(types))]
        if list(types) != engine:
            raise ValueError(f"engine.model: layer_types {list(types)} differ from vLLM 0.30's "
                             f"GPT-OSS layout (sliding window on even layers, full on odd), "
                             f"which it applies regardless of layer_types")



def shape(k: ConfigKeys) -> ModelShape:
    """GPT-OSS's config.json: every layer MoE, `num_local_experts` of `intermediate_size` with
    biases (one fused tensor per projection), a router bias, biased attention (`attention_bias`)
    with a sink per head, `sliding_window` on half the layers. OpenAI's published active
    parameters count the output layer, not the embedding."""
    bias = k.flag("attention_bias", True)
    # vLLM puts the window on the even layers (check_engine_layout refuses other layer_types)
    window = (k.num("num_hidden_layers") + 1) // 2 if k.num("sliding_window", 0) else 0
    return ModelShape(**decoder(k), moe_layer_ids=every_layer_moe(k),
                      attention=gqa(k, qkv_bias=bias, out_bias=bias, sinks=True),
                      experts=k.num("num_local_experts"), moe_ffn=k.num("intermediate_size"),
                      dense_ffn=0, expert_bias=True, router_bias=True, fused_experts=True,
                      window_layers=window, sliding_window=k.num("sliding_window", 0),
                      active_embeddings=("output",))


FAMILY = Family(
    name="gpt_oss", rank=6, tiny_config=tiny_config,
    hf_routers={"GptOssTopKRouter": "topk_softmax"},
    engine_router_dtype=replicated_gate("GptOssMoE", gate="router (with bias)"),
    megatron_arch="trainer.megatron.family_gpt_oss:gpt_oss_arch", megatron_grouped_experts=False,
    hf_attn_implementation="eager", hf_packing=False, engine_dtype="bfloat16",
    engine_check=check_engine_layout, shape=shape)
