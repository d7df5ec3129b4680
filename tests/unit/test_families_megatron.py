"""Megatron-side family support (trainer.megatron.families + hf_mapping), without building a model.

HF -> megatron -> HF must give back every checkpoint tensor unchanged for each family the megatron
backend maps; a family it cannot run is refused with the missing piece named.
"""

from __future__ import annotations

import pytest
import torch

from services.common.families import hf_config, names
from services.common.tiny_moe import TinyMoeConfig
from trainer.megatron.families import REFUSED, config_overrides, supported
from trainer.megatron.hf_mapping import arch_from_hf_config, hf_to_megatron, megatron_to_hf


def checkpoint(family: str, first_k_dense: int = 0):
    """(config dict, checkpoint-named state dict) of a tiny random `family` model."""
    from transformers import AutoModelForCausalLM

    from trainer.hf.model import export_hf

    cfg = hf_config(family, TinyMoeConfig(num_layers=2, first_k_dense=first_k_dense))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return cfg.to_dict(), export_hf(model, torch.float32)


@pytest.mark.parametrize("family,dense", [("qwen2_moe", 1), ("mixtral", 0)])
@pytest.mark.parametrize("ep_size", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(family, dense, ep_size):
    cfg, sd = checkpoint(family, dense)
    arch = arch_from_hf_config(cfg)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep_size):
        back |= megatron_to_hf(hf_to_megatron(sd, arch, rank, ep_size), arch, rank, ep_size)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_qwen2_moe_options():
    arch = arch_from_hf_config(checkpoint("qwen2_moe", 1)[0])
    assert arch.moe_layers == (1,)
    opts = config_overrides(arch.fam)
    assert opts["moe_shared_expert_gate"] and opts["add_qkv_bias"] and not opts["qk_layernorm"]
    assert opts["moe_router_pre_softmax"]  # norm_topk_prob False: softmax over all experts


def test_mixtral_options():
    arch = arch_from_hf_config(checkpoint("mixtral")[0])
    assert arch.moe_layers == (0, 1) and arch.moe_ffn == TinyMoeConfig().moe_intermediate_size
    assert not config_overrides(arch.fam)["moe_router_pre_softmax"]  # always renormalised


def test_a_refused_family_is_refused_naming_the_missing_piece(monkeypatch):
    """Every family is mapped today (REFUSED is empty); the refusal path stays for the next one."""
    monkeypatch.setitem(REFUSED, "mixtral", "the widget megatron-core lacks")
    cfg = hf_config("mixtral", TinyMoeConfig()).to_dict()
    with pytest.raises(ValueError, match="model_type: 'mixtral' is not supported by the megatron "
                       "trainer: the widget megatron-core lacks; use trainer backend 'hf'"):
        arch_from_hf_config(cfg)


def test_an_unknown_family_is_refused_naming_model_type():
    cfg = hf_config("mixtral", TinyMoeConfig()).to_dict() | {"model_type": "jamba"}
    with pytest.raises(ValueError, match="model_type: expected one of .+, got 'jamba'"):
        arch_from_hf_config(cfg)


def test_supported_and_refused_cover_every_family():

    assert set(supported()) | set(REFUSED) == set(names())
