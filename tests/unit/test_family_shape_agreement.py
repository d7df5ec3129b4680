"""The planner's reading of a config.json (its family's `shape`) is what the HF checkpoint
loaders of both trainer backends and the rollout's routing layout (the experts and top-k the
store registers, the MoE layers the rollout reports) read from the same config: one check per
family on its tiny config (issue 58)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common import families
from services.common.tiny_moe import TinyMoeConfig
from trainer.plan.layout import Arch


def _tiny(name: str) -> TinyMoeConfig:
    """Three layers, the first dense where the family has dense layers."""
    dense = name in {"qwen2_moe", "deepseek_v3", "glm4_moe"}
    return TinyMoeConfig(num_layers=3, first_k_dense=1 if dense else 0)


@pytest.mark.parametrize("name", families.names())
def test_backends_and_rollout_read_what_the_planner_reads(name: str) -> None:
    from services.rollout.engine import model_info
    from trainer.hf.routers import find_routers
    from trainer.megatron.hf_mapping import arch_from_hf_config

    hf_config = families.hf_config(name, _tiny(name))
    cfg = hf_config.to_dict()
    shape = Arch.from_hf_config(cfg)
    # HF backend: the model transformers builds from the config (what from_pretrained loads):
    # every parameter counted, routers where the planner has MoE layers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    assert sum(p.numel() for p in model.parameters()) == shape.total_params()
    assert tuple(h.hf_layer for h in find_routers(model)) == shape.moe_layer_ids
    # megatron backend: the HF -> megatron mapping's architecture
    mc = arch_from_hf_config(cfg)
    assert mc.moe_layers == shape.moe_layer_ids
    assert (mc.num_experts, mc.top_k, mc.moe_ffn) == (shape.experts, shape.top_k, shape.moe_ffn)
    assert (mc.hidden_size, mc.num_heads, mc.vocab_size) == (shape.hidden, shape.heads,
                                                              shape.vocab)
    assert mc.fam.shared_ffn == shape.shared_ffn
    if shape.dense_layers:
        assert mc.dense_ffn == shape.dense_ffn
    if mc.mla is not None:
        a = shape.attention
        assert (mc.mla.q_lora_rank or 0, mc.mla.kv_lora_rank, mc.mla.qk_rope_dim) == \
            (a.q_lora_rank, a.kv_lora_rank, a.rope_head_dim)
        assert (mc.mla.qk_nope_dim + mc.mla.qk_rope_dim, mc.mla.v_head_dim) == \
            (a.head_dim, a.v_head_dim)
    else:
        assert (mc.num_kv_heads, mc.head_dim) == (shape.attention.kv_heads,
                                                  shape.attention.head_dim)
    # rollout: the routing layout its worker sends and the store checks against its models
    info = model_info(hf_config)
    assert (info.num_experts, info.top_k, info.moe_layers) == (shape.experts, shape.top_k,
                                                               shape.moe_layer_ids)
