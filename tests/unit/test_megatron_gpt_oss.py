"""GPT-OSS on the megatron backend without building a model (trainer.megatron.family_gpt_oss).

HF -> megatron -> HF gives back every checkpoint tensor unchanged at EP 1 and EP 2 (an EP rank's
fused expert tensors hold its own experts; the ranks' slices concatenated are the checkpoint's);
the interleaved gate/up columns land as megatron's [gate rows; up rows]; the TransformerConfig
options; and what megatron-core 0.19 cannot build is refused naming the field.
"""

from __future__ import annotations

import pytest
import torch

from services.common.families import hf_config
from services.common.tiny_moe import TinyMoeConfig
from trainer.megatron.families import config_overrides
from trainer.megatron.hf_mapping import (
    arch_from_hf_config,
    expert_param_names,
    hf_to_megatron,
    megatron_to_hf,
)


def checkpoint(**overrides):
    """(config dict, checkpoint-named state dict) of a tiny random GPT-OSS, every tensor random
    (transformers initialises the biases to zero)."""
    from transformers import AutoModelForCausalLM

    from trainer.hf.model import export_hf

    cfg = hf_config("gpt_oss", TinyMoeConfig(num_layers=2))
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return cfg.to_dict(), export_hf(model, torch.float32)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(ep_size):
    cfg, sd = checkpoint()
    arch = arch_from_hf_config(cfg)
    ranks = [megatron_to_hf(hf_to_megatron(sd, arch, r, ep_size), arch, r, ep_size)
             for r in range(ep_size)]
    back = {k: torch.cat([r[k] for r in ranks]) if ".mlp.experts." in k else ranks[0][k]
            for k in ranks[0]}
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    per = arch.num_experts // ep_size
    assert all(r["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == per for r in ranks)


def test_interleaved_gate_up_becomes_gate_rows_then_up_rows():
    cfg, sd = checkpoint()
    arch = arch_from_hf_config(cfg)
    mc = hf_to_megatron(sd, arch, ep_rank=1, ep_size=2)  # rank 1: global experts 4..7
    e, local = 5, 1
    w, b = sd["model.layers.1.mlp.experts.gate_up_proj"][e], \
        sd["model.layers.1.mlp.experts.gate_up_proj_bias"][e]
    x = torch.randn(3, arch.hidden_size)
    p = f"decoder.layers.1.mlp.experts.local_experts.{local}"
    fc1 = x @ mc[f"{p}.linear_fc1.weight"].t() + mc[f"{p}.linear_fc1.bias"]
    gate, up = fc1.chunk(2, -1)  # megatron's GLU halves
    hf = x @ w + b
    assert torch.allclose(gate, hf[:, 0::2], atol=1e-5) and torch.allclose(up, hf[:, 1::2], atol=1e-5)
    down = sd["model.layers.1.mlp.experts.down_proj"][e]
    assert torch.equal(mc[f"{p}.linear_fc2.weight"], down.t())
    assert torch.equal(mc["decoder.layers.0.self_attention.core_attention.softmax_offset"],
                       sd["model.layers.0.self_attn.sinks"])
    assert torch.equal(mc["decoder.layers.0.mlp.router.bias"], sd["model.layers.0.mlp.router.bias"])


def test_megatron_glu_clamp_equals_hf_experts_activation():
    """megatron's unfused GLU (clamp gate above, linear half both sides, quick_gelu, + offset)
    with the overrides' values == HF GptOssExperts._apply_gate, clamp binding on both halves."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg, _ = checkpoint()
    opts = config_overrides(arch_from_hf_config(cfg).fam)
    assert opts["activation_func"] is quick_gelu
    c, off = opts["activation_func_clamp_value"], opts["glu_linear_offset"]
    gate_up = 6 * torch.randn(64, 2 * 32)  # well past the limit 7 on both sides
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    assert (gate > c).any() and (up < -c).any() and (up > c).any()
    # megatron.core.transformer.mlp.MLP.forward, unfused gated_linear_unit branch
    mega = quick_gelu(gate.clamp(min=None, max=c)) * (up.clamp(min=-c, max=c) + off)
    hf = GptOssExperts(hf_config("gpt_oss", TinyMoeConfig()))._apply_gate(gate_up)
    assert torch.allclose(mega, hf, atol=1e-6)


def test_transformer_config_options():
    cfg, _ = checkpoint()
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == (0, 1) and arch.moe_ffn == TinyMoeConfig().moe_intermediate_size
    opts = config_overrides(arch.fam)
    assert opts["add_bias_linear"] and opts["softmax_type"] == "learnable"
    assert not opts["moe_router_pre_softmax"] and not opts["qk_layernorm"]  # top-k softmax
    # HF: query i sees keys i - 16 < j <= i on layer_types' sliding layers (0, 2, ...)
    assert opts["window_size"] == (cfg["sliding_window"] - 1, 0)
    assert opts["window_attn_skip_freq"] == [1, 0]
    assert arch.rope_scaling.type == "yarn" and arch.rope_scaling.truncate is False
    assert arch.rope_scaling.factor == 32 and arch.rope_scaling.original_max_positions == 4096
    names = expert_param_names(arch, 4)
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.bias" in names


@pytest.mark.parametrize("field,value,msg", [
    ("swiglu_alpha", 1.5, "swiglu_alpha: 1.5 - .*quick_gelu"),
    ("attention_bias", False, "attention_bias: false"),
    ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types: expected 2"),
    ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config: 'mxfp4'"),
])
def test_unmapped_config_is_refused_naming_the_field(field, value, msg):
    cfg = hf_config("gpt_oss", TinyMoeConfig(num_layers=2)).to_dict() | {field: value}
    with pytest.raises(ValueError, match=msg):
        arch_from_hf_config(cfg)


def test_expert_tensor_parallel_is_refused_at_boot():
    from trainer.config import TrainerConfig
    from trainer.megatron.parallel import check_layout

    arch = arch_from_hf_config(checkpoint()[0])
    model = TrainerConfig(model={"expert_tensor_parallel": 2}).model
    with pytest.raises(ValueError, match="model.expert_tensor_parallel 2: gpt_oss has expert "
                       "biases"):
        check_layout(model, 2, arch, 8)
