"""GLM-4.x MoE on the megatron backend (trainer.megatron.family_glm4_moe, grouped_router,
hf_mapping), without building a model: the mapping both ways (expert bias included), the
TransformerConfig options, megatron's router function against HF's router, and the refusals.
"""

from __future__ import annotations

import json

import pytest
import torch

from services.common.families import hf_config
from services.common.tiny_moe import TinyMoeConfig
from trainer.megatron.families import config_overrides
from trainer.megatron.grouped_router import GroupedSigmoidRouter, grouped_router_from_hf
from trainer.megatron.hf_mapping import arch_from_hf_config, hf_to_megatron, megatron_to_hf


def glm_config(**over) -> dict:
    cfg = hf_config("glm4_moe", TinyMoeConfig(num_layers=3, first_k_dense=1)).to_dict()
    return cfg | over


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(config dict, state dict, HF model) of the tiny glm4_moe as `r3flow model tiny-moe` writes
    it (non-zero selection bias)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from services.common.families import build_family

    d = build_family(tmp_path_factory.mktemp("glm"), "glm4_moe",
                     TinyMoeConfig(num_layers=3, first_k_dense=1))
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    cfg = json.loads((d / "config.json").read_text())
    return cfg, load_file(str(d / "model.safetensors")), model


@pytest.mark.parametrize("ep_size", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact_with_the_expert_bias(built, ep_size):
    cfg, sd, _ = built
    arch = arch_from_hf_config(cfg)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep_size):
        mc = hf_to_megatron(sd, arch, rank, ep_size)
        bias = mc["decoder.layers.1.mlp.router.expert_bias"]
        assert torch.equal(bias, sd["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert bias.abs().max() > 0  # the tiny model's bias is non-zero
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in mc
        assert "decoder.layers.0.mlp.router.weight" not in mc  # first_k_dense_replace
        back |= megatron_to_hf(mc, arch, rank, ep_size)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_arch_and_transformer_config_options():
    cfg = glm_config()
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == (1, 2) and arch.num_experts == cfg["n_routed_experts"]
    assert arch.rotary_percent == 0.5 and arch.head_dim == cfg["head_dim"]
    opts = config_overrides(arch.fam)
    assert opts["moe_router_score_function"] == "sigmoid"
    assert opts["moe_router_enable_expert_bias"] and opts["moe_router_bias_update_rate"] == 0.0
    assert (opts["moe_router_num_groups"], opts["moe_router_group_topk"]) == (2, 1)
    assert opts["moe_router_topk_scaling_factor"] == cfg["routed_scaling_factor"]
    assert opts["add_qkv_bias"] and not opts["qk_layernorm"]
    assert opts["moe_shared_expert_intermediate_size"] == cfg["moe_intermediate_size"]
    assert not opts["moe_shared_expert_gate"]
    assert config_overrides(arch_from_hf_config(glm_config(use_qk_norm=True)).fam)["qk_layernorm"]
    # transformers and vLLM default GLM's partial_rotary_factor to 0.5 when the config lacks it
    bare = glm_config(rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert arch_from_hf_config(bare).rotary_percent == 0.5


def test_one_group_is_no_group_limit():
    r = grouped_router_from_hf(glm_config(n_group=1, topk_group=1, routed_scaling_factor=1.0),
                               2, 8)
    assert r == GroupedSigmoidRouter(None, None, None)


def test_megatron_router_function_equals_hf_router_with_bias_and_groups(built):
    """megatron's topk_routing_with_score_function under the mapped options picks HF's experts
    with HF's weights, and the bias changes some selections (so the test sees it)."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    cfg, _, model = built
    gate = model.model.layers[1].mlp.gate
    opts = config_overrides(arch_from_hf_config(cfg).fam)
    torch.manual_seed(1)
    x_TH = torch.randn(256, cfg["hidden_size"])
    with torch.no_grad():
        logits_TE, w_TK, ids_TK = gate(x_TH)
        probs_TK, mc_ids_TK = topk_routing_with_score_function(
            logits_TE, cfg["num_experts_per_tok"], num_groups=opts["moe_router_num_groups"],
            group_topk=opts["moe_router_group_topk"],
            scaling_factor=opts["moe_router_topk_scaling_factor"], score_function="sigmoid",
            expert_bias=gate.e_score_correction_bias, dense_output=True)
        unbiased_TK = torch.topk(logits_TE, cfg["num_experts_per_tok"], -1).indices
    order_hf, order_mc = ids_TK.argsort(-1), mc_ids_TK.argsort(-1)
    assert torch.equal(ids_TK.gather(-1, order_hf), mc_ids_TK.gather(-1, order_mc))
    assert torch.allclose(w_TK.gather(-1, order_hf), probs_TK.gather(-1, order_mc), atol=1e-6)
    changed = (ids_TK.sort(-1).values != unbiased_TK.sort(-1).values).any(-1)
    assert changed.float().mean() > 0.05, "bias and groups should change some selections"


@pytest.mark.parametrize("over,field", [
    ({"norm_topk_prob": False}, "norm_topk_prob: False"),
    ({"n_group": 2, "topk_group": 2}, "topk_group: 2 with num_experts_per_tok 2"),
    ({"n_group": 3}, "n_group: 3 groups do not divide the 8 experts"),
    ({"n_shared_experts": 0}, "n_shared_experts: 0"),
    ({"topk_group": 3}, "topk_group: 3 must be between 1 and n_group"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                          "original_max_position_embeddings": 512,
                          "partial_rotary_factor": 0.5}},
     "rope_scaling.partial_rotary_factor: partial rotary with yarn"),
])
def test_unmapped_settings_are_refused_by_field(over, field):
    with pytest.raises(ValueError, match=field):
        arch_from_hf_config(glm_config(**over))


def test_top1_with_norm_topk_prob_is_refused():
    with pytest.raises(ValueError, match="norm_topk_prob: True with num_experts_per_tok 1"):
        grouped_router_from_hf(glm_config(n_group=1, topk_group=1), 1, 8)
