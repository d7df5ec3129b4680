"""How the HF MoE families of the registry (services.common.families) map onto megatron-core 0.19.

Each family module names its FamilyArch builder by a dotted path (`megatron_arch`, resolved here:
family_basic.py for Qwen3-MoE, Qwen2-MoE and Mixtral, family_<name>.py for the others); the
FamilyArch holds the facts `hf_mapping.MoeArch` reads beyond Qwen3-MoE's (QKV bias, QK-norm, shared
expert and its gate, DeepSeek-V3's grouped sigmoid router from `grouped_router`, partial rotary,
GPT-OSS's sinks, windows and fused experts); `config_overrides` turns it into the TransformerConfig
options that reproduce the family's router. A family the registry gives no `megatron_arch`, or one
in REFUSED, is refused naming the missing piece (the HF backend, trainer.backend=hf, runs all).
The model provider (trainer.megatron.model) applies `config_overrides` on top of its base config.
"""

from __future__ import annotations

from typing import Any

from services.common import families
from trainer.megatron.family_arch import FamilyArch
from trainer.megatron.grouped_router import router_options

# model_type -> why the megatron backend refuses it (the HF backend, trainer.backend=hf, runs all).
REFUSED: dict[str, str] = {}


def supported() -> tuple[str, ...]:
    """The registered families the megatron backend maps (REFUSED left out)."""
    return tuple(f.name for f in families.all_families()
                 if f.megatron_arch and f.name not in REFUSED)


def check_supported(cfg: dict) -> str:
    """The family (HF model_type) of `cfg`; ValueError naming what the megatron backend lacks."""
    family = cfg.get("model_type")
    if family in REFUSED:
        raise ValueError(f"model_type: {family!r} is not supported by the megatron trainer: "
                         f"{REFUSED[family]}; use trainer backend 'hf'")
    fam = families.find(family)
    if fam is None or not fam.megatron_arch:
        raise ValueError(f"model_type: expected one of {', '.join(supported())}, got {family!r}")
    return str(family)


def family_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of a supported HF config dict, from the family's `megatron_arch` hook."""
    fam = families.get(check_supported(cfg))
    return families.hook(str(fam.megatron_arch))(cfg)


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
