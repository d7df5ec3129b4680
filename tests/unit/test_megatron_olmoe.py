"""OLMoE on the megatron backend, without building a model: the HF <-> megatron mapping, the
family's options, the full-width QK-norm module against HF's, its TP layout, and the refusal of
clip_qkv (by field)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_families_megatron import checkpoint

from services.common.families import hf_config
from services.common.tiny_moe import TinyMoeConfig
from trainer.megatron.families import config_overrides
from trainer.megatron.family_olmoe import FullKNorm, FullQNorm
from trainer.megatron.hf_mapping import arch_from_hf_config, hf_to_megatron, megatron_to_hf


@pytest.mark.parametrize("ep_size", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(ep_size):
    cfg, sd = checkpoint("olmoe")
    arch = arch_from_hf_config(cfg)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep_size):
        mc = hf_to_megatron(sd, arch, rank, ep_size)
        # the full-width norms land in megatron's q/k layernorm slots, whole
        assert mc["decoder.layers.0.self_attention.q_layernorm.weight"].shape == (128,)
        assert mc["decoder.layers.0.self_attention.k_layernorm.weight"].shape == (64,)
        back |= megatron_to_hf(mc, arch, rank, ep_size)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_olmoe_options():
    arch = arch_from_hf_config(checkpoint("olmoe")[0])
    assert arch.moe_layers == (0, 1) and arch.moe_ffn == TinyMoeConfig().moe_intermediate_size
    assert arch.num_experts == TinyMoeConfig().num_experts
    assert arch.fam.full_qk_norm and arch.fam.qk_norm
    opts = config_overrides(arch.fam)
    assert opts["qk_layernorm"] and opts["moe_router_pre_softmax"]  # norm_topk_prob False


def _tcfg(tp: int = 1):
    return SimpleNamespace(num_attention_heads=4, num_query_groups=2, params_dtype=torch.float32,
                           tensor_model_parallel_size=tp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_width_norm_equals_hf_q_norm_and_k_norm(dtype):
    """On megatron's [S, B, heads, d] q/k, the slot modules equal HF's OlmoeRMSNorm applied to
    the [S, B, heads*d] projection (weights HF's, unchanged)."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    torch.manual_seed(0)
    for cls, heads in ((FullQNorm, 4), (FullKNorm, 2)):
        ours = cls(_tcfg(), hidden_size=32, eps=1e-5).to(dtype)
        hf = OlmoeRMSNorm(heads * 32, eps=1e-5).to(dtype)
        with torch.no_grad():
            hf.weight.normal_(1.0, 0.2)
            ours.weight.copy_(hf.weight)
        x = torch.randn(5, 3, heads, 32, dtype=dtype)
        assert torch.equal(ours(x), hf(x.reshape(5, 3, -1)).view_as(x))
        # not the per-head norm megatron's qk_layernorm would apply
        per_head = torch.nn.RMSNorm(32, eps=1e-5).to(dtype)(x)
        assert not torch.allclose(ours(x) / ours.weight.view(heads, 32), per_head, atol=1e-3)


def test_tensor_parallel_keeps_the_whole_weight_on_every_rank():
    """Under TP a rank normalises its slice of the heads but holds the whole weight (megatron sums
    q/k layernorm grads over TP by name); the layout check accepts TP for olmoe."""
    from trainer.megatron.config import ModelConfig
    from trainer.megatron.parallel import check_layout

    q, k = FullQNorm(_tcfg(tp=2), hidden_size=32), FullKNorm(_tcfg(tp=2), hidden_size=32)
    assert (q.heads, k.heads, q.weight.shape, k.weight.shape) == (2, 1, (128,), (64,))
    assert not getattr(q.weight, "tensor_model_parallel", False)
    arch = arch_from_hf_config(checkpoint("olmoe")[0])
    assert check_layout(ModelConfig(tensor_parallel=2, sequence_parallel=True), 2, arch) == 1


def test_clip_qkv_is_refused_naming_the_field():
    cfg = hf_config("olmoe", TinyMoeConfig()).to_dict() | {"clip_qkv": 8.0}
    with pytest.raises(ValueError, match="clip_qkv: 8.0 - OLMoE's clamp of q/k/v has no "
                       "megatron-core 0.19 option"):
        arch_from_hf_config(cfg)
