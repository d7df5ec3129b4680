"""`Family`: the neutral facts of one MoE model family, and the helpers its tiny builder shares.

The type every family module (services/common/families/<name>.py) builds and the registry
(services.common.families) collects. Nothing here imports torch, transformers (only inside the
builders), the trainer or the rollout service: every process can read a family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.families._shape import ConfigKeys, ModelShape
from services.common.tiny_moe import TinyMoeConfig, vocab_size


@dataclass(frozen=True)
class Family:
    """One MoE family (an HF `model_type`): what each backend, the rollout service, `r3flow local`
    and the planner need to know about it. Backend code that needs torch or megatron is named by
    a dotted path ("module:function") that the backend resolves, so this package imports none."""

    name: str  # HF config.json model_type
    rank: int  # place in listings and error messages (the default family is 0)
    tiny_config: Callable[[TinyMoeConfig], Any]  # transformers config of the tiny random model
    # HF router class (transformers 5.24) -> replay rule of trainer.hf.routers.RULES
    hf_routers: Mapping[str, str]
    # what vLLM 0.30 computes router logits in (fp32 | native) and why: megatron router_dtype auto
    engine_router_dtype: tuple[str, str]
    # "module:function" (cfg dict -> trainer.megatron.family_arch.FamilyArch), resolved by the
    # megatron backend; None: the megatron backend refuses the family (the HF backend runs it)
    megatron_arch: str | None = None
    mla: bool = False  # multi-latent attention (vLLM's DeepseekV2 MLA; megatron MLA config)
    megatron_grouped_experts: bool = True  # megatron's grouped expert module can run its experts
    hf_attn_implementation: str | None = None  # HF backend attention the family needs (None: any)
    hf_packing: bool = True  # transformers' masks isolate packed samples for this family
    engine_dtype: str | None = None  # the only vLLM-CPU dtype that runs it (None: the run's)
    engine_check: Callable[[Any], None] | None = None  # refuses an HF config vLLM runs otherwise
    # config.json -> the sizes the planner counts (layers, experts, widths, attention, vocab):
    # the family's own key names (services.common.families._shape); None: not plannable
    shape: Callable[[ConfigKeys], ModelShape] | None = None
    # planner: known model name -> its HF config.json keys (nothing downloaded)
    planner_models: Mapping[str, Callable[[], dict]] = field(default_factory=dict)
    build: Callable[[Any, TinyMoeConfig], Any] | None = None  # own tiny writer (None: generic)

    @property
    def hf_knobs(self) -> dict[str, Any]:
        """HF backend knobs (trainer `hf:` section) the family cannot train without."""
        knobs: dict[str, Any] = {}
        if self.hf_attn_implementation:
            knobs["attn_implementation"] = self.hf_attn_implementation
        if not self.hf_packing:
            knobs["packing"] = False
        return knobs


def replicated_gate(block: str, gate: str = "gate") -> tuple[str, str]:
    """`engine_router_dtype` of a vLLM 0.30 MoE `block` whose `gate` is a ReplicatedLinear, which
    computes router logits in the model dtype."""
    return ("native", f"vLLM 0.30 {block}: the {gate} is a ReplicatedLinear in the model dtype")


def common(cfg: TinyMoeConfig) -> dict[str, Any]:
    """The transformers config fields every tiny family shares."""
    if cfg.top_k > cfg.num_experts:
        raise ValueError("top_k: must be <= num_experts")
    if cfg.router_aux_loss_coef:
        raise ValueError("router_aux_loss_coef: only the qwen3_moe tiny model takes it (the "
                         "margin recipe of the GPU model); the other families build with 0")
    return dict(vocab_size=vocab_size(), hidden_size=cfg.hidden_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
                num_key_value_heads=cfg.num_key_value_heads, num_experts_per_tok=cfg.top_k,
                max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")


def no_dense(cfg: TinyMoeConfig, family: str) -> None:
    if cfg.first_k_dense:
        raise ValueError(f"first_k_dense: {family} has no dense layers (every layer is MoE)")


def dense_first(cfg: TinyMoeConfig) -> None:
    if cfg.first_k_dense >= cfg.num_layers:
        raise ValueError("first_k_dense: must leave at least one MoE layer")


def grouped(cfg: TinyMoeConfig) -> dict[str, Any]:
    """Group-limited top-k that limits: half the groups are chosen per token."""
    dense_first(cfg)
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
