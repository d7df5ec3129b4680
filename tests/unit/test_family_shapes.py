"""Each family reads its own published config.json (services/common/families/<name>.py `shape`),
and the planner counts the published total and active parameters from that reading, within 2%.

The config.json dicts are written out here from the public model cards (the keys the families
read, with their published values; nothing downloaded); each cites its card. Published active
parameters follow each vendor's own convention for the embedding tables (ModelShape.
active_embeddings): Qwen, Mistral and OLMoE count both, DeepSeek and OpenAI the output layer only
(DeepSeek-V3's README_WEIGHTS.md: "36.6B (including 0.9B for the output Head)"), Z.ai neither.
"""

from __future__ import annotations

import pytest

from services.common.errors import UserError
from trainer.plan.layout import Arch

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "attention_bias": False, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}
# https://huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json
QWEN15_MOE_A27B = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
    "decoder_sparse_step": 1, "norm_topk_prob": False, "vocab_size": 151936,
    "tie_word_embeddings": False, "max_position_embeddings": 8192, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
}
# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "sliding_window": None,
    "router_aux_loss_coef": 0.02,
}
# https://huggingface.co/allenai/OLMoE-1B-7B-0924/blob/main/config.json
OLMOE_1B_7B = {
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "hidden_size": 2048,
    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
    "norm_topk_prob": False, "attention_bias": False, "clip_qkv": None, "vocab_size": 50304,
    "tie_word_embeddings": False, "max_position_embeddings": 4096, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-05,
}
# https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "attention_bias": False, "num_nextn_predict_layers": 1,
    "vocab_size": 129280, "tie_word_embeddings": False, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
}
# https://huggingface.co/zai-org/GLM-4.5-Air/blob/main/config.json
GLM_45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
    "n_routed_experts": 128, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False,
    "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1, "vocab_size": 151552,
    "tie_word_embeddings": False, "max_position_embeddings": 131072, "rope_theta": 1000000,
    "rms_norm_eps": 1e-05,
}
# https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json
GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
    "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128,
    "num_experts_per_tok": 4, "experts_per_token": 4, "attention_bias": True,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
    "vocab_size": 201088, "tie_word_embeddings": False, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "swiglu_limit": 7.0,
}

# (config.json, published total, published active parameters): the cards' figures
PUBLISHED = {
    "Qwen3-30B-A3B": (QWEN3_30B_A3B, 30.5e9, 3.3e9),
    "Qwen1.5-MoE-A2.7B": (QWEN15_MOE_A27B, 14.3e9, 2.7e9),
    "Mixtral-8x7B": (MIXTRAL_8X7B, 46.7e9, 12.9e9),
    "OLMoE-1B-7B": (OLMOE_1B_7B, 6.9e9, 1.3e9),
    "DeepSeek-V3": (DEEPSEEK_V3, 671e9, 37e9),  # without the MTP layer
    "GLM-4.5-Air": (GLM_45_AIR, 106e9, 12e9),
    "gpt-oss-120b": (GPT_OSS_120B, 117e9, 5.1e9),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_totals_and_actives_within_two_percent(name: str) -> None:
    cfg, total, active = PUBLISHED[name]
    arch = Arch.from_hf_config(cfg)
    assert arch.total_params() == pytest.approx(total, rel=0.02), arch.total_params()
    assert arch.active_params() == pytest.approx(active, rel=0.02), arch.active_params()


def test_deepseek_v3_counts_its_dense_layers_shared_expert_and_mla() -> None:
    a = Arch.from_hf_config(DEEPSEEK_V3)
    assert (a.dense_layers, a.moe_layer_ids[0], a.shared_ffn) == (3, 3, 2048)
    # MLA: q 7168*1536 + 1536*128*192, kv 7168*(512+64) + 512*128*(128+128), o 128*128*7168;
    # norms of the two latents (1536 + 512) and the layer's two (2*7168) replicated
    split = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert a.attention_params() == (split, 1536 + 512 + 2 * 7168)
    # the cache holds the latent and the rope key, on every TP rank
    assert a.attention.kv_cache_elems(tp=8) == 512 + 64
    # every third layer MoE: the family reads moe_layer_freq as DeepSeek's and vLLM's code do
    third = Arch.from_hf_config(DEEPSEEK_V3 | {"moe_layer_freq": 3})
    assert third.moe_layer_ids[:3] == (3, 6, 9) and third.moe_layers == 20


def test_experts_width_is_the_familys_key() -> None:
    mixtral, olmoe = Arch.from_hf_config(MIXTRAL_8X7B), Arch.from_hf_config(OLMOE_1B_7B)
    assert (mixtral.experts, mixtral.moe_ffn, mixtral.dense_layers) == (8, 14336, 0)
    assert (olmoe.experts, olmoe.moe_ffn, olmoe.attention.qk_norm) == (64, 1024, "full")
    glm = Arch.from_hf_config(GLM_45_AIR)
    assert (glm.dense_layers, glm.shared_ffn, glm.attention.qkv_bias) == (1, 1408, True)


def test_unknown_model_type_and_missing_keys_are_one_line() -> None:
    with pytest.raises(UserError, match=r"^model config: model_type: 'llama' is not a "
                       r"registered family \(qwen3_moe, .*gpt_oss\)$"):
        Arch.from_hf_config({"model_type": "llama", "hidden_size": 4096})
    bad = {k: v for k, v in MIXTRAL_8X7B.items() if k != "num_local_experts"}
    with pytest.raises(UserError, match=r"^model config: missing key 'num_local_experts'$"):
        Arch.from_hf_config(bad)
    no_experts = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    with pytest.raises(UserError, match=r"^model config: missing key 'num_experts' \(or "
                       r"'num_local_experts'\)$"):
        Arch.from_hf_config(no_experts)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts: read either
    assert Arch.from_hf_config(no_experts | {"num_local_experts": 128}).experts == 128
    with pytest.raises(UserError, match=r"^model config: hidden_size: '4k' is not an integer$"):
        Arch.from_hf_config(MIXTRAL_8X7B | {"hidden_size": "4k"})


def test_memory_follows_the_family() -> None:
    from trainer.plan.layout import Layout
    from trainer.plan.memory import plan, push_chunk_bytes
    from trainer.plan.rollout import kv_bytes_per_token, plan_rollout

    gpt, ds = Arch.from_hf_config(GPT_OSS_120B), Arch.from_hf_config(DEEPSEEK_V3)
    qwen = Arch.from_hf_config(QWEN3_30B_A3B)
    # the push's chunks: GPT-OSS's fused gate_up_proj [128, 2880, 5760], DeepSeek-V3's
    # embedding [129280, 7168], both larger than a 1 GiB bucket; Qwen3's embedding is not
    lay = Layout(world=8, ep=8, push_bucket_bytes=1 << 30)
    assert push_chunk_bytes(gpt, lay) == 2 * 128 * 2880 * 5760
    assert push_chunk_bytes(ds, lay) == 2 * 129280 * 7168
    assert push_chunk_bytes(qwen, lay) == 1 << 30
    assert plan(gpt, lay, 141).rows["weight push"] == 6 * 2 * 128 * 2880 * 5760
    # the rollout's KV cache: MLA's latent + rope key on every rank; GQA's 4 KV heads of Qwen3
    # one per rank at TP 4 and replicated at TP 8
    assert kv_bytes_per_token(ds, tp=8) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token(qwen, tp=4) == kv_bytes_per_token(qwen, tp=8) == 48 * 2 * 128 * 2
    # GPT-OSS: 18 full layers, and 18 of window 128 that keep 128 of an 8K sequence's tokens
    assert kv_bytes_per_token(gpt, tp=1, seq_len=8192) == (18 + 18 * 128 / 8192) * 2 * 8 * 64 * 2
    assert kv_bytes_per_token(gpt, tp=1, seq_len=64) == 36 * 2 * 8 * 64 * 2
    engine = plan_rollout(Arch.from_hf_config(MIXTRAL_8X7B), 80, 0.85, 8192, 64)
    assert engine.fits and engine.total_params == Arch.from_hf_config(MIXTRAL_8X7B).total_params()
    assert engine.active_params == Arch.from_hf_config(MIXTRAL_8X7B).active_params()


def test_known_models_are_the_published_configs() -> None:
    from trainer.plan.models import load_model_config

    for name, cfg in (("Qwen3-30B-A3B", QWEN3_30B_A3B), ("Mixtral-8x7B", MIXTRAL_8X7B),
                      ("DeepSeek-V3", DEEPSEEK_V3)):
        known = load_model_config(name)
        assert Arch.from_hf_config(known) == Arch.from_hf_config(cfg), name
