"""HF tensor naming for engine weight loads, and which layers are MoE (no engine)."""

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe, hf_config
from services.rollout.engine import model_info, moe_layer_ids
from services.rollout.worker_ext import unfuse_hf_experts


def test_unfused_in_memory_tensors_equal_the_checkpoint(tmp_path):
    """transformers keeps experts fused in memory; the split must equal what it saves."""
    from transformers import AutoModelForCausalLM

    out = build_tiny_moe(tmp_path / "m", TinyMoeConfig(num_layers=2, first_k_dense=1))
    on_disk = load_file(out / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    in_memory = dict(model.state_dict().items())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in in_memory)
    unfused = dict(unfuse_hf_experts(in_memory.items()))
    assert sorted(unfused) == sorted(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(unfused[name], tensor), name


def test_unfuse_rejects_wrong_rank():
    with pytest.raises(ValueError, match="3-D fused expert tensor"):
        list(unfuse_hf_experts([("model.layers.0.mlp.experts.down_proj", torch.zeros(2, 2))]))


def test_moe_layers_of_tiny_moe_with_dense_first_layer():
    info = model_info(hf_config(TinyMoeConfig(num_layers=3, first_k_dense=1)))
    assert info.moe_layers == (1, 2) and info.num_layers == 3
    assert info.num_experts == 8 and info.top_k == 2


def test_moe_layers_deepseek_style():
    cfg = SimpleNamespace(num_hidden_layers=5, first_k_dense_replace=2, moe_layer_freq=1)
    assert moe_layer_ids(cfg) == [2, 3, 4]


def test_dense_model_rejected():
    cfg = SimpleNamespace(num_hidden_layers=2, vocab_size=10, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="not an MoE model"):
        model_info(cfg)


def _gpt_oss(layer_types: list[str]) -> SimpleNamespace:
    return SimpleNamespace(model_type="gpt_oss", num_hidden_layers=len(layer_types),
                           layer_types=layer_types, num_local_experts=4, num_experts_per_tok=2,
                           vocab_size=10)


def test_gpt_oss_layer_types_vllm_would_not_follow_are_refused():
    """vLLM 0.30 puts GPT-OSS's sliding window on the even layers whatever layer_types says;
    the trainer follows layer_types, so a different pattern would train other attention."""
    assert model_info(_gpt_oss(["sliding_attention", "full_attention"] * 2)).num_layers == 4
    with pytest.raises(ValueError, match=r"engine.model: layer_types .* differ from vLLM 0.30"):
        model_info(_gpt_oss(["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="engine.model: layer_types"):
        model_info(_gpt_oss(["sliding_attention"] * 2))
