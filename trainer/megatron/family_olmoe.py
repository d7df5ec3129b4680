"""OLMoE on megatron-core 0.19: QK-norm over the whole q/k projection, through the layer spec.

HF `OlmoeAttention` normalises q_proj's output ([T, nh*d]) and k_proj's ([T, ng*d]) with one
RMSNorm each over the FULL projection width, before the heads are split; megatron-core's
`qk_layernorm` normalises each head (width d). megatron's SelfAttention builds whatever class
the spec puts in `q_layernorm` / `k_layernorm` (with `hidden_size=head_dim`, `config`, `eps`)
and applies it to query [S, B, np, d] and key [S, B, ng_local, d] right after the QKV split;
`FullQNorm` / `FullKNorm` take their width from the config and normalise over the last two dims.
Their weights are HF's q_norm / k_norm weights as they are: megatron's query heads come out of the
per-group QKV layout in HF head order (the q heads of KV group g are HF heads g*nh/ng ..).

Under tensor parallelism each rank holds a contiguous slice of the heads (megatron requires TP to
divide the KV heads, `parallel.check_layout`): the sum of squares is all-reduced over the TP group
(autograd's all_reduce: its backward all-reduces the gradient, since every rank's output depends
on every rank's q/k). The weight stays whole on every rank (like megatron's per-head q/k norms,
whose grads `finalize_model_grads` sums over TP by their `q_layernorm`/`k_layernorm` names):
each rank uses its heads' slice, so the summed grad is the full one on every rank.
HF `clip_qkv` (a clamp of
q/k/v after the norm) has no megatron-core option: refused by name.
Legend: S sequence, B batch, d head dim, nh / ng query / KV heads, np heads of this rank.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.megatron.family_arch import FamilyArch

FAMILY = "olmoe"


def check_config(cfg: dict) -> None:
    """ValueError naming an OLMoE config option the megatron mapping does not reproduce."""
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv: {cfg['clip_qkv']} - OLMoE's clamp of q/k/v has no "
                         "megatron-core 0.19 option; only clip_qkv null is supported")
    heads, width = cfg["num_attention_heads"], cfg["hidden_size"]
    if (cfg.get("head_dim") or width // heads) * heads != width:
        raise ValueError("head_dim: OLMoE's q_norm has width hidden_size, so heads x head_dim "
                         "must equal hidden_size")


def olmoe_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of an olmoe HF config dict (services/common/families/olmoe.py names it)."""
    check_config(cfg)
    return FamilyArch(full_qk_norm=True, renormalise=bool(cfg.get("norm_topk_prob", False)))


class _FullWidthRMSNorm(torch.nn.Module):
    """RMSNorm over the last two dims ([.., heads, d] as one vector of heads*d, all ranks' heads
    together), HF's order of operations: fp32 statistics, cast back, then the weight."""

    def __init__(self, head_dim: int, heads: int, eps: float, config: Any) -> None:
        super().__init__()
        tp = config.tensor_model_parallel_size
        if heads % tp:
            raise ValueError(f"model.tensor_parallel {tp}: does not divide the {heads} heads of "
                             "OLMoE's full-width QK-norm")
        self.heads, self.width, self.eps, self.tp = heads // tp, heads * head_dim, eps, tp
        self.weight = torch.nn.Parameter(torch.ones(self.width, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] != self.heads:
            raise ValueError(f"qk norm: expected {self.heads} heads, got shape {tuple(x.shape)}")
        h = x.reshape(*x.shape[:-2], -1).float()
        weight: torch.Tensor
        if self.tp == 1:
            weight, var = self.weight, h.pow(2).mean(-1, keepdim=True)
        else:
            import torch.distributed.nn.functional as dist_fn
            from megatron.core import parallel_state as ps

            local = h.shape[-1]
            weight = self.weight.narrow(0, ps.get_tensor_model_parallel_rank() * local, local)
            var = dist_fn.all_reduce(h.pow(2).sum(-1, keepdim=True),
                                     group=ps.get_tensor_model_parallel_group()) / self.width
        h = h * torch.rsqrt(var + self.eps)
        return (weight * h.to(x.dtype)).view_as(x)


class FullQNorm(_FullWidthRMSNorm):
    """megatron `q_layernorm` slot: RMSNorm over all query heads (HF `q_norm`)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, config.num_attention_heads, eps, config)


class FullKNorm(_FullWidthRMSNorm):
    """megatron `k_layernorm` slot: RMSNorm over all KV heads (HF `k_norm`)."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(hidden_size, config.num_query_groups, eps, config)


def full_width_qk_norm(spec: Any) -> Any:
    """The decoder block spec with every layer's q/k layernorm swapped for the full-width ones
    (through the spec's own submodule fields)."""
    for layer in spec.layer_specs:
        attn = layer.submodules.self_attention.submodules
        attn.q_layernorm, attn.k_layernorm = FullQNorm, FullKNorm
    return spec
