"""Which HF MoE families the megatron backend builds, and how each maps onto megatron-core 0.19.

Owns, per HF `model_type`: the facts `hf_mapping.MoeArch` reads beyond Qwen3-MoE's (expert count
and width keys, dense layers, QKV bias, QK-norm, shared expert and its gate, DeepSeek-V3's grouped
sigmoid router from `grouped_router`, partial rotary; family_<name>.py modules hold the facts of
one family), the TransformerConfig
options that reproduce the family's router (`config_overrides`), and the refusal of a family
megatron-core 0.19's local spec cannot run or r3flow does not map yet, naming the missing piece.
The model provider (trainer.megatron.model) applies `config_overrides` on top of its base config.
GPT-OSS's own facts (sinks, sliding windows, clamped experts, fused expert tensors) live in
`trainer.megatron.family_gpt_oss`.
"""

from __future__ import annotations

from typing import Any

from trainer.megatron import family_olmoe
from trainer.megatron.family_arch import FamilyArch
from trainer.megatron.grouped_router import router_options

SUPPORTED = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "gpt_oss", "deepseek_v3")

# model_type -> why the megatron backend refuses it (the HF backend, trainer.backend=hf, runs all).
REFUSED: dict[str, str] = {}


def check_supported(cfg: dict) -> str:
    """The family (HF model_type) of `cfg`; ValueError naming what the megatron backend lacks."""
    family = cfg.get("model_type")
    if family in REFUSED:
        raise ValueError(f"model_type: {family!r} is not supported by the megatron trainer: "
                         f"{REFUSED[family]}; use trainer backend 'hf'")
    if family not in SUPPORTED:
        raise ValueError(f"model_type: expected one of {', '.join(SUPPORTED)}, got {family!r}")
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) \
            and family == "mixtral":
        raise ValueError("sliding_window: Mixtral's sliding-window attention is not mapped")
    return str(family)


def family_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of a supported HF config dict."""
    family = check_supported(cfg)
    if family == "qwen2_moe":
        return FamilyArch(qkv_bias=bool(cfg.get("qkv_bias", True)), qk_norm=False,
                          shared_ffn=int(cfg.get("shared_expert_intermediate_size") or 0),
                          shared_gate=True,
                          renormalise=bool(cfg.get("norm_topk_prob", False)))
    if family == "olmoe":
        family_olmoe.check_config(cfg)
        return FamilyArch(full_qk_norm=True, renormalise=bool(cfg.get("norm_topk_prob", False)))
    if family == "mixtral":
        return FamilyArch(qk_norm=False, renormalise=True, moe_prefix="block_sparse_moe",
                          expert_proj=("w1", "w3", "w2"))
    if family == "glm4_moe":
        from trainer.megatron.family_glm4_moe import glm4_moe_arch

        return glm4_moe_arch(cfg)
    if family == "gpt_oss":
        from trainer.megatron.family_gpt_oss import gpt_oss_arch

        return gpt_oss_arch(cfg)
    if family == "deepseek_v3":
        from trainer.megatron.family_deepseek_v3 import deepseek_v3_arch

        return deepseek_v3_arch(cfg)
    return FamilyArch(renormalise=bool(cfg.get("norm_topk_prob", True)))


def sizes(cfg: dict) -> dict[str, int]:
    """Experts, expert FFN and dense FFN widths under each family's key names."""
    # every layer MoE; intermediate_size is the expert's
    if cfg.get("model_type") in ("mixtral", "olmoe", "gpt_oss"):
        experts = cfg.get("num_local_experts") or cfg["num_experts"]
        return {"num_experts": experts, "moe_ffn": cfg["intermediate_size"],
                "dense_ffn": cfg["intermediate_size"]}
    return {"num_experts": cfg.get("num_experts") or cfg.get("n_routed_experts")
            or cfg["num_local_experts"],
            "moe_ffn": cfg["moe_intermediate_size"], "dense_ffn": cfg["intermediate_size"]}


def config_overrides(fam: FamilyArch) -> dict[str, Any]:
    """TransformerConfig options of the family (on top of the provider's Qwen3-MoE base)."""
    out: dict[str, Any] = {
        "qk_layernorm": fam.qk_norm, "add_qkv_bias": fam.qkv_bias,
        # HF renormalised top-k == softmax over the top-k logits (megatron's non-pre-softmax)
        "moe_router_pre_softmax": not fam.renormalise, "moe_router_score_function": "softmax"}
    if fam.router is not None:
        out |= router_options(fam.router)
    if fam.shared_ffn:
        out |= {"moe_shared_expert_intermediate_size": fam.shared_ffn,
                "moe_shared_expert_gate": fam.shared_gate, "moe_shared_expert_overlap": False}
    if fam.linear_bias:  # also gives the router its bias (megatron Router.bias)
        out["add_bias_linear"] = True
    if fam.attn_sinks:  # DotProductAttention.softmax_offset: a sink logit per head
        out["softmax_type"] = "learnable"
    if fam.window:  # megatron's window (left, right) excludes the query itself
        out |= {"window_size": (fam.window - 1, 0),
                "window_attn_skip_freq": [int(w) for w in fam.window_layers]}
    if fam.glu_clamp is not None:
        from megatron.core.fusions.fused_bias_geglu import quick_gelu  # x * sigmoid(1.702 x)

        out |= {"activation_func": quick_gelu, "glu_linear_offset": 1.0,
                "activation_func_clamp_value": fam.glu_clamp}
    return out


# What the rollout engine computes router logits in, per family (model.router_dtype: auto).
ENGINE_ROUTER_DTYPE: dict[str, tuple[str, str]] = {
    "qwen2_moe": ("native", "vLLM 0.30 Qwen2MoeSparseMoeBlock: the gate is a ReplicatedLinear "
                  "in the model dtype"),
    "mixtral": ("native", "vLLM 0.30 MixtralMoE: the gate is a ReplicatedLinear in the model "
                "dtype"),
    "olmoe": ("native", "vLLM 0.30 OlmoeMoE: the gate is a ReplicatedLinear in the model dtype"),
    "glm4_moe": ("fp32", "vLLM 0.30 Glm4MoE: the gate is an fp32 nn.Linear on fp32 hidden states"),
    "gpt_oss": ("native", "vLLM 0.30 GptOssMoE: the router is a ReplicatedLinear (with bias) in "
                "the model dtype"),
    "deepseek_v3": ("native", "vLLM 0.30 DeepseekV2MoE: the gate is a GateLinear in the model "
                    "dtype (fp32 only with config moe_router_dtype float32, or on CUDA kernels)"),
}
