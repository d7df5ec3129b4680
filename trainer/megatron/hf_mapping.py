"""HF MoE checkpoint names/layouts <-> megatron-core GPTModel (local spec), both ways.

Qwen3-MoE is the base layout; what other families change (QKV bias, no QK-norm, a gated shared
expert, Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`) comes from the FamilyArch their registry
hook builds (`trainer.megatron.families`), and so does the part of the mapping a family owns
(`FamilyArch.mapping`, trainer.megatron.family_arch.WeightMapping): DeepSeek-V3's multi-latent
attention (family_deepseek_v3), GPT-OSS's fused expert tensors, sinks and biases (family_gpt_oss).
This module imports no family module.

HF names are the safetensors names the rollout engine loads (one tensor per expert projection).
Layouts that differ:
  * attention: HF q/k/v [nh*d, H], [ng*d, H], [ng*d, H] -> megatron `linear_qkv` [(nh+2ng)*d, H]
    grouped per KV group g as [q heads of g (nh/ng of them), k_g, v_g] (GQA interleave);
  * MLP / experts: megatron `linear_fc1` = cat(gate_proj, up_proj) on dim 0 (gated linear unit);
  * experts under expert parallelism: rank r holds global experts [r*El, (r+1)*El) as
    `local_experts.0..El-1`.
Dense layers (as the family's `model_shape` reads config.json: HF `mlp_only_layers`,
`first_k_dense_replace`, ...) are plain MLPs; the rest are MoE (megatron `moe_layer_freq`). DeepSeek-V3's router (GLM-4.x MoE) adds the selection bias
`gate.e_score_correction_bias` <-> the router's `expert_bias` buffer (trainer.megatron.grouped_router).
Partial rotary (`partial_rotary_factor`) is megatron's `rotary_percent` (MoeArch.rotary_percent).
Grouped experts (model.experts: grouped) hold each layer's experts stacked; `megatron_to_hf` and
`gather_experts` read them in the per-expert layout (trainer.megatron.grouped_experts).
RoPE (scaling, partial rotary) is read by trainer.megatron.rope.
Legend: H hidden, d head dim, nh query heads, ng KV groups, E experts, El local experts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from services.common import families
from trainer.megatron.families import family_arch
from trainer.megatron.family_arch import FamilyArch, MlaArch
from trainer.megatron.grouped_experts import unstack_experts
from trainer.megatron.grouped_router import bias_to_hf, bias_to_megatron
from trainer.megatron.rope import RopeScaling, rope_from_hf_config, rotary_percent

_ATTN = {"self_attn.o_proj": "self_attention.linear_proj",
         "self_attn.q_norm": "self_attention.q_layernorm",
         "self_attn.k_norm": "self_attention.k_layernorm",
         "input_layernorm": "input_layernorm",
         "post_attention_layernorm": "pre_mlp_layernorm"}
# a family that maps its own attention (MLA) maps its norms of q/k too: no per-head QK-norm here
_ATTN_OWN = {h: m for h, m in _ATTN.items() if h not in ("self_attn.q_norm", "self_attn.k_norm")}
GLOBAL_UNIT = -1  # export unit of the tensors outside the decoder layers (unit_to_hf)
_GLOBAL = {"model.embed_tokens.weight": "embedding.word_embeddings.weight",
           "model.norm.weight": "decoder.final_layernorm.weight",
           "lm_head.weight": "output_layer.weight"}


@dataclass(frozen=True)
class MoeArch:
    """The architecture facts the mapping and the model builder need, from an HF config."""

    num_layers: int
    moe_layers: tuple[int, ...]  # HF layer indices whose MLP is an MoE block
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_ffn: int
    dense_ffn: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    norm_topk_prob: bool
    max_positions: int
    rope_scaling: RopeScaling = RopeScaling()
    rotary_percent: float = 1.0  # HF partial_rotary_factor
    family: str = families.DEFAULT  # HF model_type
    fam: FamilyArch = FamilyArch()  # what the family changes against Qwen3-MoE
    mla: MlaArch | None = None  # multi-latent attention (DeepSeek-V3), else GQA

    @property
    def moe_layer_freq(self) -> list[int]:
        """megatron `moe_layer_freq` pattern: 1 = MoE layer, 0 = dense."""
        return [int(i in self.moe_layers) for i in range(self.num_layers)]


def arch_from_hf_config(cfg: dict) -> MoeArch:
    """Read an HF MoE config.json dict; ValueError names unsupported families and fields."""
    fam = family_arch(cfg)
    if cfg.get("tie_word_embeddings"):
        raise ValueError("tie_word_embeddings: tied embeddings are not supported")
    if cfg.get("attention_bias") and not fam.qkv_bias:
        raise ValueError("attention_bias: biased attention projections are not supported")
    # the family's reading of its config.json: which layers are MoE, its experts' key names
    shape = families.model_shape(cfg)
    rope_theta, rope_scaling = rope_from_hf_config(cfg, fam.partial_rotary)
    mla = fam.mla  # MLA: one latent, as many KV heads as q heads
    return MoeArch(
        num_layers=shape.num_layers, moe_layers=shape.moe_layer_ids, hidden_size=shape.hidden,
        mla=mla, num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_attention_heads"] if mla else cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        top_k=shape.top_k, num_experts=shape.experts, moe_ffn=shape.moe_ffn,
        # megatron's ffn_hidden_size wants a width even where no layer is dense (Mixtral,
        # OLMoE, GPT-OSS: their intermediate_size is the experts' width)
        dense_ffn=shape.dense_ffn or shape.moe_ffn,
        vocab_size=shape.vocab, rms_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta, rope_scaling=rope_scaling, rotary_percent=rotary_percent(
            cfg, fam.partial_rotary or 1.0),
        family=cfg["model_type"],
        norm_topk_prob=fam.renormalise, fam=fam,
        max_positions=cfg.get("max_position_embeddings", 4096))


def load_arch(hf_dir: str | Path) -> MoeArch:
    """MoeArch of the HF checkpoint directory `hf_dir`."""
    return arch_from_hf_config(json.loads((Path(hf_dir) / "config.json").read_text()))


def qkv_to_megatron(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: MoeArch) -> torch.Tensor:
    """HF q/k/v weights -> megatron fused linear_qkv weight (per-KV-group interleave)."""
    ng, per, d, h = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim, q.shape[1]
    parts = (q.view(ng, per, d, h), k.view(ng, 1, d, h), v.view(ng, 1, d, h))
    return torch.cat(parts, dim=1).reshape(-1, h)


def qkv_to_hf(qkv: torch.Tensor, a: MoeArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron fused linear_qkv weight -> HF (q, k, v) weights."""
    ng, per, d, h = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim, qkv.shape[1]
    grouped = qkv.view(ng, per + 2, d, h)
    q, k, v = grouped.split([per, 1, 1], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


_PROJ = ("gate_proj", "up_proj", "down_proj")


def _mlp_to_megatron(sd: dict, hf_prefix: str, mc_prefix: str,
                     proj: tuple[str, str, str] = _PROJ) -> dict[str, torch.Tensor]:
    gate, up, down = proj
    fc1 = torch.cat([sd[f"{hf_prefix}.{gate}.weight"], sd[f"{hf_prefix}.{up}.weight"]], 0)
    return {f"{mc_prefix}.linear_fc1.weight": fc1,
            f"{mc_prefix}.linear_fc2.weight": sd[f"{hf_prefix}.{down}.weight"]}


def _mlp_to_hf(sd: dict, mc_prefix: str, hf_prefix: str,
               proj: tuple[str, str, str] = _PROJ) -> dict[str, torch.Tensor]:
    gate, up = sd[f"{mc_prefix}.linear_fc1.weight"].chunk(2, dim=0)
    return {f"{hf_prefix}.{proj[0]}.weight": gate, f"{hf_prefix}.{proj[1]}.weight": up,
            f"{hf_prefix}.{proj[2]}.weight": sd[f"{mc_prefix}.linear_fc2.weight"]}


def _qkv_bias_to_megatron(sd: dict, hf: str, a: MoeArch) -> torch.Tensor:
    q, k, v = (sd[f"{hf}.self_attn.{p}_proj.bias"].unsqueeze(1) for p in "qkv")
    return qkv_to_megatron(q, k, v, a).squeeze(1)


def _qkv_bias_to_hf(bias: torch.Tensor, a: MoeArch) -> dict[str, torch.Tensor]:
    q, k, v = qkv_to_hf(bias.unsqueeze(1), a)
    return {f"self_attn.{p}_proj.bias": t.squeeze(1) for p, t in zip("qkv", (q, k, v), strict=True)}


def _moe_extras_to_megatron(sd: dict, a: MoeArch, hf: str, mc: str) -> dict[str, torch.Tensor]:
    """Router (and its selection bias) and shared expert (with its sigmoid gate) of one MoE
    layer."""
    moe = f"{hf}.{a.fam.moe_prefix}"
    out = {f"{mc}.mlp.router.weight": sd[f"{moe}.gate.weight"]}
    if a.fam.router is not None:
        out |= bias_to_megatron(sd, moe, mc)
    if a.fam.shared_ffn:
        out |= _mlp_to_megatron(sd, f"{moe}.{a.fam.shared_prefix}", f"{mc}.mlp.shared_experts")
    if a.fam.shared_gate:
        out[f"{mc}.mlp.shared_experts.gate_weight"] = sd[f"{moe}.shared_expert_gate.weight"]
    return out


def _moe_extras_to_hf(sd: dict, a: MoeArch, mc: str, hf: str) -> dict[str, torch.Tensor]:
    moe = f"{hf}.{a.fam.moe_prefix}"
    out = {f"{moe}.gate.weight": sd[f"{mc}.mlp.router.weight"]}
    if a.fam.router is not None:
        out |= bias_to_hf(sd, mc, moe)
    if a.fam.shared_ffn:
        out |= _mlp_to_hf(sd, f"{mc}.mlp.shared_experts", f"{moe}.{a.fam.shared_prefix}")
    if a.fam.shared_gate:
        out[f"{moe}.shared_expert_gate.weight"] = sd[f"{mc}.mlp.shared_experts.gate_weight"]
    return out


def _local_experts(a: MoeArch, ep_rank: int, ep_size: int) -> range:
    if a.num_experts % ep_size:
        raise ValueError(f"expert_parallel: {a.num_experts} experts not divisible by {ep_size}")
    per = a.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def _layer_to_megatron(sd: dict, a: MoeArch, i: int, ep_rank: int, ep_size: int) -> dict:
    hf, mc = f"model.layers.{i}", f"decoder.layers.{i}"
    own = a.fam.mapping
    out = {f"{mc}.{m}.weight": sd[f"{hf}.{h}.weight"]
           for h, m in (_ATTN_OWN if own.attention_to_megatron else _ATTN).items()
           if f"{hf}.{h}.weight" in sd}
    if own.attention_to_megatron is not None:
        out |= own.attention_to_megatron(sd, a.fam, hf, mc)
    else:
        q, k, v = (sd[f"{hf}.self_attn.{p}_proj.weight"] for p in "qkv")
        out[f"{mc}.self_attention.linear_qkv.weight"] = qkv_to_megatron(q, k, v, a)
    if a.fam.qkv_bias:
        out[f"{mc}.self_attention.linear_qkv.bias"] = _qkv_bias_to_megatron(sd, hf, a)
    if own.experts_to_megatron is not None:  # GPT-OSS: every layer MoE
        return out | own.experts_to_megatron(sd, hf, mc, _local_experts(a, ep_rank, ep_size))
    if i not in a.moe_layers:
        return out | _mlp_to_megatron(sd, f"{hf}.mlp", f"{mc}.mlp")
    out |= _moe_extras_to_megatron(sd, a, hf, mc)
    for local, e in enumerate(_local_experts(a, ep_rank, ep_size)):
        out |= _mlp_to_megatron(sd, f"{hf}.{a.fam.moe_prefix}.experts.{e}",
                                f"{mc}.mlp.experts.local_experts.{local}", a.fam.expert_proj)
    return out


def _layer_to_hf(sd: dict, a: MoeArch, i: int, ep_rank: int, ep_size: int,
                 experts: bool | None = None) -> dict:
    """Layer `i` -> HF names: everything (`experts` None), only the routed experts (True:
    `sd` needs only their tensors), or all but them (False; not for fused-expert families,
    whose expert mapping carries other tensors too)."""
    hf, mc, own = f"model.layers.{i}", f"decoder.layers.{i}", a.fam.mapping
    moe = a.fam.fused_experts or i in a.moe_layers
    if experts:
        return _experts_to_hf(sd, a, hf, mc, _local_experts(a, ep_rank, ep_size)) if moe else {}
    if experts is False and own.experts_to_hf is not None:
        raise ValueError("experts: a fused-expert family maps its experts with other tensors")
    out = {f"{hf}.{h}.weight": sd[f"{mc}.{m}.weight"]
           for h, m in (_ATTN_OWN if own.attention_to_hf else _ATTN).items()
           if f"{mc}.{m}.weight" in sd}
    if own.attention_to_hf is not None:
        out |= own.attention_to_hf(sd, a.fam, mc, hf)
    else:
        q, k, v = qkv_to_hf(sd[f"{mc}.self_attention.linear_qkv.weight"], a)
        out |= {f"{hf}.self_attn.q_proj.weight": q, f"{hf}.self_attn.k_proj.weight": k,
                f"{hf}.self_attn.v_proj.weight": v}
    if a.fam.qkv_bias:
        out |= {f"{hf}.{n}": t for n, t in _qkv_bias_to_hf(
            sd[f"{mc}.self_attention.linear_qkv.bias"], a).items()}
    if not moe:
        return out | _mlp_to_hf(sd, f"{mc}.mlp", f"{hf}.mlp")
    if own.experts_to_hf is None:
        out |= _moe_extras_to_hf(sd, a, mc, hf)
    if experts is None:
        out |= _experts_to_hf(sd, a, hf, mc, _local_experts(a, ep_rank, ep_size))
    return out


def _experts_to_hf(sd: dict, a: MoeArch, hf: str, mc: str, local_ids: range
                   ) -> dict[str, torch.Tensor]:
    """The routed experts `local_ids` (global ids) of one layer."""
    own = a.fam.mapping.experts_to_hf
    if own is not None:  # GPT-OSS: with the layer's sinks, router and o_proj bias
        return own(sd, mc, hf, local_ids)
    out: dict[str, torch.Tensor] = {}
    for local, e in enumerate(local_ids):
        out |= _mlp_to_hf(sd, f"{mc}.mlp.experts.local_experts.{local}",
                          f"{hf}.{a.fam.moe_prefix}.experts.{e}", a.fam.expert_proj)
    return out


def hf_to_megatron(sd: dict[str, torch.Tensor], a: MoeArch, ep_rank: int = 0,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """HF state dict -> this EP rank's megatron parameter dict (local experts only)."""
    out = {m: sd[h] for h, m in _GLOBAL.items()}
    for i in range(a.num_layers):
        out |= _layer_to_megatron(sd, a, i, ep_rank, ep_size)
    return out


def megatron_to_hf(sd: dict[str, torch.Tensor], a: MoeArch, ep_rank: int = 0,
                   ep_size: int = 1) -> dict[str, torch.Tensor]:
    """This EP rank's megatron parameter dict -> HF names (its local experts under global ids);
    grouped experts' stacked weights are read as SequentialMLP's per-expert ones."""
    sd = unstack_experts(sd)
    out = {h: sd[m] for h, m in _GLOBAL.items()}
    for i in range(a.num_layers):
        out |= _layer_to_hf(sd, a, i, ep_rank, ep_size)
    return out


GLOBAL_NAMES = tuple(_GLOBAL.values())  # megatron names of the GLOBAL_UNIT


def unit_to_megatron(sd: Mapping[str, torch.Tensor], a: MoeArch, unit: int, ep_rank: int = 0,
                     ep_size: int = 1, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """One export unit of an HF checkpoint (a mapping read on access: LazyCheckpoint) -> this
    EP rank's megatron tensors: `GLOBAL_UNIT` (those megatron names in `wanted`, default all)
    or decoder layer `unit` (global index). Reads only that unit's tensors."""
    if unit == GLOBAL_UNIT:
        return {m: sd[h] for h, m in _GLOBAL.items() if wanted is None or m in wanted}
    return _layer_to_megatron(cast(dict, sd), a, unit, ep_rank, ep_size)  # read by key only


def unit_to_hf(sd: dict[str, torch.Tensor], a: MoeArch, unit: int, ep_rank: int = 0,
               ep_size: int = 1, experts: bool | None = None) -> dict[str, torch.Tensor]:
    """One export unit of this EP rank's megatron tensors -> HF names: `GLOBAL_UNIT` (embedding,
    final norm, output layer: those of them in `sd`) or decoder layer `unit` (global index);
    `experts`: True only its routed experts, False all but them (`_layer_to_hf`)."""
    if unit == GLOBAL_UNIT:
        return {} if experts else {h: sd[m] for h, m in _GLOBAL.items() if m in sd}
    return _layer_to_hf(unstack_experts(sd), a, unit, ep_rank, ep_size, experts)


def expert_param_names(a: MoeArch, num_local: int) -> list[str]:
    """Megatron names of every local-expert parameter, in a fixed order (for EP gathers)."""
    kinds = ("weight", "bias") if a.fam.linear_bias else ("weight",)
    return [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{j}.{kind}"
            for i in a.moe_layers for e in range(num_local) for j in (1, 2) for kind in kinds]


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def gather_experts(params: dict[str, torch.Tensor], a: MoeArch) -> dict[str, torch.Tensor]:
    """Replace local-expert params by all experts (global ids) via all_gather on the EP group
    (grouped experts' stacked weights first split into SequentialMLP's per-expert names)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    params = unstack_experts(params)
    ep = ps.get_expert_model_parallel_world_size()
    if ep == 1:
        return params
    group, per = ps.get_expert_model_parallel_group(), a.num_experts // ep
    out = {k: v for k, v in params.items() if ".local_experts." not in k}
    for name in expert_param_names(a, per):
        local = params[name].detach().contiguous()
        shards = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(shards, local, group=group)
        head, tail = name.split(".local_experts.")
        idx, rest = tail.split(".", 1)
        for r, t in enumerate(shards):
            out[f"{head}.local_experts.{r * per + int(idx)}.{rest}"] = t
    return out


def export_hf_state_dict(model: torch.nn.Module, a: MoeArch) -> dict[str, torch.Tensor]:
    """HF-named full state dict of a (possibly DDP-wrapped, EP-sharded) model; collective on EP."""
    from trainer.megatron.parallel import model_weights

    params = {k: v.detach() for k, v in model_weights(_unwrap(model)).items()}
    return {k: v.clone() for k, v in megatron_to_hf(gather_experts(params, a), a).items()}
