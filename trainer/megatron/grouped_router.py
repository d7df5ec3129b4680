"""DeepSeek-V3's router (GLM-4.x MoE shares it) on megatron-core 0.19's own TopKRouter options.

HF computes, per token: scores = sigmoid(logits); the experts are chosen on scores +
`e_score_correction_bias` (a buffer, selection only), group-limited (`n_group` groups, the
`topk_group` best by the sum of each group's top-2 biased scores); the gate weights are the
UNBIASED scores at the chosen experts, renormalised when `norm_topk_prob`, times
`routed_scaling_factor`. megatron-core's `topk_routing_with_score_function` with
`moe_router_score_function="sigmoid"`, `moe_router_enable_expert_bias` (the HF buffer is the
router's `expert_bias` buffer), `moe_router_num_groups` / `moe_router_group_topk` and
`moe_router_topk_scaling_factor` is the same computation where:
  * its group score sums each group's top `topk // group_topk` scores: HF's top-2 only when
    `num_experts_per_tok / topk_group == 2` (or with one group, where grouping is a no-op);
  * it always renormalises the sigmoid top-k (k > 1) and never for k == 1.
Other settings are refused by field name. Under replay megatron gathers the unbiased scores at
the replayed ids (what HF forced routing does).

The expert bias is a checkpoint constant in RL: megatron's aux-loss-free balancing would move it
after every step (`finalize_model_grads` -> `_update_router_expert_bias`, rate
`moe_router_bias_update_rate`), changing the trainer's routing away from the engine's. It is held
fixed twice over: the update rate is 0 and each router is marked `frozen_expert_bias` (the flag
megatron's update skips, so no tokens-per-expert all-reduce runs either).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HF_BIAS = "gate.e_score_correction_bias"  # under the HF MoE block (model.layers.N.mlp)
MC_BIAS = "router.expert_bias"  # under the megatron MoE layer (decoder.layers.N.mlp)


@dataclass(frozen=True)
class GroupedSigmoidRouter:
    """The router's options beyond softmax top-k (what TransformerConfig needs)."""

    num_groups: int | None  # None: no group limit (HF n_group 1)
    group_topk: int | None
    scaling_factor: float | None  # None: 1.0


def _check_groups(n_group: int, topk_group: int, top_k: int, num_experts: int) -> None:
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group: {n_group} groups do not divide the {num_experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: {topk_group} must be between 1 and n_group ({n_group})")
    if n_group > 1 and (top_k % topk_group or top_k // topk_group != 2):
        raise ValueError(
            f"topk_group: {topk_group} with num_experts_per_tok {top_k} - HF scores a group by "
            "its top-2 experts, megatron-core 0.19 by its top num_experts_per_tok/topk_group "
            f"({top_k / topk_group:g}); only a ratio of 2 (or n_group 1) maps exactly")


def grouped_router_from_hf(cfg: dict, top_k: int, num_experts: int) -> GroupedSigmoidRouter:
    """The router of a DeepSeek-V3 / GLM-4.x MoE HF config; ValueError names unmapped fields."""
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise ValueError(f"scoring_func: {scoring!r} - only DeepSeek-V3's sigmoid router is "
                         "mapped onto megatron-core")
    method = cfg.get("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ValueError(f"topk_method: {method!r} - only 'noaux_tc' (selection bias, "
                         "group-limited top-k) is mapped onto megatron-core")
    norm = bool(cfg.get("norm_topk_prob", True))
    if top_k > 1 and not norm:
        raise ValueError("norm_topk_prob: False - megatron-core 0.19's sigmoid router always "
                         "renormalises the top-k weights (num_experts_per_tok > 1)")
    if top_k == 1 and norm:
        raise ValueError("norm_topk_prob: True with num_experts_per_tok 1 - HF's weight is then "
                         "1.0, megatron-core 0.19 keeps the sigmoid score")
    n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    _check_groups(n_group, topk_group, top_k, num_experts)
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    return GroupedSigmoidRouter(num_groups=n_group if n_group > 1 else None,
                                group_topk=topk_group if n_group > 1 else None,
                                scaling_factor=scale if scale != 1.0 else None)


def deepseek_moe_fields(cfg: dict, block: str) -> dict[str, Any]:
    """FamilyArch fields of DeepSeek-V3's MoE block (GLM-4.x MoE has the same): this router and
    an ungated shared expert of width n_shared_experts * moe_intermediate_size (HF
    `mlp.shared_experts`). `block`: the transformers class, for the error message."""
    router = grouped_router_from_hf(cfg, int(cfg["num_experts_per_tok"]),
                                    int(cfg["n_routed_experts"]))
    if int(cfg.get("n_shared_experts", 1)) < 1:
        raise ValueError(f"n_shared_experts: 0 - transformers' {block} then builds a zero-width "
                         "shared expert (not mapped)")
    return {"router": router, "renormalise": True, "shared_gate": False,
            "shared_ffn": int(cfg["n_shared_experts"]) * int(cfg["moe_intermediate_size"]),
            "shared_prefix": "shared_experts"}


def router_options(r: GroupedSigmoidRouter) -> dict[str, Any]:
    """TransformerConfig options of the router (the expert bias held fixed)."""
    return {"moe_router_score_function": "sigmoid", "moe_router_pre_softmax": False,
            "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0,
            "moe_router_num_groups": r.num_groups, "moe_router_group_topk": r.group_topk,
            "moe_router_topk_scaling_factor": r.scaling_factor}


def bias_to_megatron(sd: dict, hf_moe: str, mc_layer: str) -> dict[str, Any]:
    """The selection bias of one MoE layer, HF name -> megatron name."""
    return {f"{mc_layer}.mlp.{MC_BIAS}": sd[f"{hf_moe}.{HF_BIAS}"]}


def bias_to_hf(sd: dict, mc_layer: str, hf_moe: str) -> dict[str, Any]:
    """The selection bias of one MoE layer, megatron name -> HF name."""
    return {f"{hf_moe}.{HF_BIAS}": sd[f"{mc_layer}.mlp.{MC_BIAS}"]}


def freeze_expert_bias(routers: list) -> None:
    """Mark every router's expert_bias fixed (megatron's update skips frozen routers)."""
    for r in routers:
        if getattr(r, "expert_bias", None) is not None:
            r.frozen_expert_bias = True
