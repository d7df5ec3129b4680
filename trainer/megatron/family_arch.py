"""`FamilyArch`: what an HF MoE family changes against Qwen3-MoE in the megatron layer layout.

The type shared by the family registry (trainer.megatron.families) and the family modules
(family_<name>.py) that build it: the registry imports the families, a family never imports the
registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.megatron.grouped_router import GroupedSigmoidRouter


@dataclass(frozen=True)
class FamilyArch:
    """What a family changes against Qwen3-MoE in the layer layout (default: Qwen3-MoE)."""

    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2-MoE)
    qk_norm: bool = True  # per-head RMSNorm of q and k (Qwen3-MoE)
    full_qk_norm: bool = False  # ... over the whole q/k projection instead (OLMoE; spec swap)
    shared_ffn: int = 0  # shared-expert FFN width (0: none)
    shared_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE)
    renormalise: bool = True  # softmax over the top-k (HF norm_topk_prob / Mixtral always)
    moe_prefix: str = "mlp"  # HF module of the MoE block (Mixtral: block_sparse_moe)
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1 w3 w2
    shared_prefix: str = "shared_expert"  # HF module of the shared expert (DeepSeek/GLM: plural)
    router: GroupedSigmoidRouter | None = None  # DeepSeek-V3's router (None: softmax top-k)
    partial_rotary: float | None = None  # HF partial_rotary_factor's default where the family's
    # HF model reads it (GLM-4.x MoE: 0.5); None: ignored by HF, refused unless 1
    # GPT-OSS (trainer.megatron.family_gpt_oss): every linear (q/k/v/o, router, experts) biased
    linear_bias: bool = False
    attn_sinks: bool = False  # a learned per-head sink logit (megatron softmax_type learnable)
    window: int = 0  # sliding-window width in tokens, the query's own included (0: none)
    window_layers: tuple[bool, ...] = ()  # per layer: sliding (True) or full attention
    glu_clamp: float | None = None  # experts: quick_gelu(min(g, c)) * (clamp(u, -c, c) + 1)
    fused_experts: bool = False  # HF experts as per-layer [E, ...] tensors, gate/up interleaved
