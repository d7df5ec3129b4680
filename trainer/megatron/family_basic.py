"""The families whose megatron facts are a few FamilyArch flags: Qwen3-MoE (the base layout),
Qwen2-MoE (QKV bias, no QK-norm, a sigmoid-gated shared expert, no renormalisation) and Mixtral
(no QK-norm, always renormalised, `block_sparse_moe.experts.N.w1/w3/w2`).

Named by their family modules (services/common/families/<name>.py: `megatron_arch`) and resolved
by trainer.megatron.families; a family never imports the registry.
"""

from __future__ import annotations

from trainer.megatron.family_arch import FamilyArch


def qwen3_moe_arch(cfg: dict) -> FamilyArch:
    return FamilyArch(renormalise=bool(cfg.get("norm_topk_prob", True)))


def qwen2_moe_arch(cfg: dict) -> FamilyArch:
    return FamilyArch(qkv_bias=bool(cfg.get("qkv_bias", True)), qk_norm=False,
                      shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0),
                      shared_gate=True, renormalise=bool(cfg.get("norm_topk_prob", False)))


def mixtral_arch(cfg: dict) -> FamilyArch:
    """ValueError for Mixtral's sliding-window attention (not mapped)."""
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        raise ValueError("sliding_window: Mixtral's sliding-window attention is not mapped")
    return FamilyArch(qk_norm=False, renormalise=True, moe_prefix="block_sparse_moe",
                      expert_proj=("w1", "w3", "w2"))
