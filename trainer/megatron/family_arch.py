"""`FamilyArch`: what an HF MoE family changes against Qwen3-MoE in the megatron layer layout,
and the parts of the weight mapping a family owns (`WeightMapping`: trainer.megatron.hf_mapping
calls them for the layers they cover and maps the rest itself).

The types shared by the family registry (trainer.megatron.families), the weight mapping and the
family modules (family_<name>.py) that build them: the registry and the mapping import no family
module (a family is reached through its registry hook), a family never imports the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.megatron.grouped_router import GroupedSigmoidRouter


@dataclass(frozen=True)
class MlaArch:
    """MLA sizes of an HF DeepSeek-V3 config (trainer.megatron.family_deepseek_v3)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    rope_interleave: bool = True


# (state dict, the family's arch, source layer prefix, destination layer prefix) -> tensors
AttentionMap = Callable[[dict, "FamilyArch", str, str], dict[str, torch.Tensor]]
# (state dict, source layer prefix, destination layer prefix, this rank's experts' global ids)
ExpertMap = Callable[[dict, str, str, range], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class WeightMapping:
    """The family's own part of one decoder layer's HF <-> megatron weight mapping (None: the
    base layout's, trainer.megatron.hf_mapping). A pair per direction."""

    # q/k/v and their norms (o_proj and the layer norms stay the base's): DeepSeek-V3's MLA
    attention_to_megatron: AttentionMap | None = None
    attention_to_hf: AttentionMap | None = None
    # the MoE block (router, experts) with what the family stores with it: GPT-OSS's fused
    # experts, sinks and biases
    experts_to_megatron: ExpertMap | None = None
    experts_to_hf: ExpertMap | None = None


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
    mla: MlaArch | None = None  # multi-latent attention (DeepSeek-V3), else GQA
    mapping: WeightMapping = field(default_factory=WeightMapping)  # the family's own mapping
