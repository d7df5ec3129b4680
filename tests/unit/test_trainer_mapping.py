"""HF <-> megatron name/layout mapping on random tensors (no megatron import), and configs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.megatron.hf_mapping import (
    arch_from_hf_config,
    hf_to_megatron,
    megatron_to_hf,
    qkv_to_hf,
    qkv_to_megatron,
)

CFG = {"model_type": "qwen3_moe", "num_hidden_layers": 3, "mlp_only_layers": [0],
       "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 6,
       "intermediate_size": 12, "vocab_size": 20, "rope_parameters": {"rope_theta": 1e6}}


def _hf_state(a) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h, d = a.hidden_size, a.head_dim
    sd = {"model.embed_tokens.weight": r(a.vocab_size, h), "model.norm.weight": r(h),
          "lm_head.weight": r(a.vocab_size, h)}
    for i in range(a.num_layers):
        p = f"model.layers.{i}"
        sd |= {f"{p}.input_layernorm.weight": r(h), f"{p}.post_attention_layernorm.weight": r(h),
               f"{p}.self_attn.q_proj.weight": r(a.num_heads * d, h),
               f"{p}.self_attn.k_proj.weight": r(a.num_kv_heads * d, h),
               f"{p}.self_attn.v_proj.weight": r(a.num_kv_heads * d, h),
               f"{p}.self_attn.o_proj.weight": r(h, a.num_heads * d),
               f"{p}.self_attn.q_norm.weight": r(d), f"{p}.self_attn.k_norm.weight": r(d)}
        if i in a.moe_layers:
            sd[f"{p}.mlp.gate.weight"] = r(a.num_experts, h)
            experts = [f"{p}.mlp.experts.{e}" for e in range(a.num_experts)]
            ffn = a.moe_ffn
        else:
            experts, ffn = [f"{p}.mlp"], a.dense_ffn
        for e in experts:
            sd |= {f"{e}.gate_proj.weight": r(ffn, h), f"{e}.up_proj.weight": r(ffn, h),
                   f"{e}.down_proj.weight": r(h, ffn)}
    return sd


def test_arch_reads_dense_layers_and_rope():
    a = arch_from_hf_config(CFG)
    assert a.moe_layers == (1, 2) and a.moe_layer_freq == [0, 1, 1] and a.rope_theta == 1e6
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        arch_from_hf_config(CFG | {"tie_word_embeddings": True})
    with pytest.raises(ValueError, match="model_type"):
        arch_from_hf_config(CFG | {"model_type": "llama"})


def test_qkv_groups_queries_with_their_kv_head():
    a = arch_from_hf_config(CFG)
    d, h = a.head_dim, a.hidden_size
    q = torch.arange(4 * d).repeat_interleave(h).view(4 * d, h).float()  # row i holds i
    k, v = q[: 2 * d] + 1000, q[: 2 * d] + 2000
    fused = qkv_to_megatron(q, k, v, a)
    # group 0: q heads 0,1 then k0 then v0; group 1: q heads 2,3, k1, v1
    starts = fused[:, 0].view(2, 4, d)[:, :, 0].tolist()
    assert starts == [[0, d, 1000, 2000], [2 * d, 3 * d, 1000 + d, 2000 + d]]
    assert all(torch.equal(x, y) for x, y in zip(qkv_to_hf(fused, a), (q, k, v), strict=True))


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_state_dict_round_trip_is_exact_for_every_expert_shard(ep):
    a = arch_from_hf_config(CFG)
    sd = _hf_state(a)
    back: dict[str, torch.Tensor] = {}
    for rank in range(ep):
        mc = hf_to_megatron(sd, a, rank, ep)
        n_local = sum(1 for k in mc if "layers.1.mlp.experts" in k and "fc1" in k)
        assert n_local == a.num_experts // ep
        back |= megatron_to_hf(mc, a, rank, ep)
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    mc = hf_to_megatron(sd, a)
    fc1 = mc["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1[: a.moe_ffn], sd["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(mc["decoder.layers.2.mlp.router.weight"], sd["model.layers.2.mlp.gate.weight"])
    assert "decoder.layers.0.mlp.linear_fc1.weight" in mc  # the dense layer is a plain MLP


def test_uneven_expert_parallel_is_rejected():
    a = arch_from_hf_config(CFG)
    with pytest.raises(ValueError, match="expert_parallel"):
        hf_to_megatron(_hf_state(a), a, 0, 3)


def test_trainer_config_names_bad_keys(tmp_path):
    from services.common.config import ConfigError, load_config
    from trainer.config import TrainerConfig

    p = tmp_path / "t.json"
    p.write_text('{"replay": {"mode": "r4"}}')
    with pytest.raises(ConfigError, match="replay.mode"):
        load_config(TrainerConfig, p)
    p.write_text('{"optim": {"lrr": 1}}')
    with pytest.raises(ConfigError, match="optim.lrr: unknown key"):
        load_config(TrainerConfig, p)
    with pytest.raises(ConfigError, match="world_size"):
        load_config(TrainerConfig, None, {"run.world_size": 2})
    cfg = load_config(TrainerConfig, None, {"replay.mode": "r2", "run.steps": 3})
    assert cfg.replay.mode == "r2" and cfg.run.steps == 3 and np.isfinite(cfg.optim.lr)


def test_example_config_loads():
    from pathlib import Path

    from services.common.config import load_config
    from trainer.config import TrainerConfig

    path = Path(__file__).resolve().parents[2] / "trainer/configs/tiny_r3.toml"
    cfg = load_config(TrainerConfig, path, {"data.store": "127.0.0.1:1"})
    assert cfg.replay.mode == "r3" and cfg.data.store == "127.0.0.1:1"


def test_rope_scaling_megatron_can_build_is_kept():
    from trainer.megatron.hf_mapping import RopeScaling

    a = arch_from_hf_config(CFG)
    assert a.rope_scaling == RopeScaling()
    lin = arch_from_hf_config(CFG | {"rope_parameters": None, "rope_theta": 5e5,
                                     "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (lin.rope_theta, lin.rope_scaling.type, lin.rope_scaling.factor) == (5e5, "linear", 2)
    yarn = arch_from_hf_config(CFG | {"max_position_embeddings": 4096, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
        "original_max_position_embeddings": 1024}})
    assert yarn.rope_scaling == RopeScaling("yarn", 4.0, 1024)
    # transformers 5 writes rope_parameters; a 4.x rope_scaling next to it still scales
    both = arch_from_hf_config(CFG | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert both.rope_scaling == RopeScaling("llama3", 8.0, 8192) and both.rope_theta == 1e6


@pytest.mark.parametrize("rope, field", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling.type"),
    ({"type": "longrope", "factor": 2.0}, "rope_scaling.type"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0},
     "rope_scaling.low_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4096},
     "rope_scaling.original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.0},
     "rope_scaling.attention_factor"),
    ({"rope_type": "linear", "factor": 0.5}, "rope_scaling.factor"),
    ({"rope_type": "default", "partial_rotary_factor": 0.5}, "rope_scaling.partial_rotary_factor"),
])
def test_rope_scaling_megatron_cannot_build_is_refused_by_name(rope, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        arch_from_hf_config(CFG | {"rope_scaling": rope})
