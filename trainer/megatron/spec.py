"""The decoder layer spec: megatron-core 0.19's local (non-TransformerEngine) GPT spec, with a
sequence-parallel-capable RMSNorm when `sequence_parallel` is on.

The local spec's norm, `megatron.core.transformer.torch_norm.WrappedTorchNorm`, asserts
`not config.sequence_parallel` only because it does not tag its weight: under sequence
parallelism each TP rank normalises its own tokens, so the replicated norm weights need their
gradients summed over the TP group, which `finalize_model_grads` does for parameters tagged
`sequence_parallel` (what TransformerEngine's norms set). `SequenceParallelRMSNorm` is that
torch RMSNorm, tagged; the spec swaps it in through the spec's own submodule fields.
GPT-OSS's learnable sinks and expert biases swap two more modules the same way
(`family_gpt_oss.swap_modules`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any

import torch

from trainer.megatron.fused_attention import SdpaAttention, applies
from trainer.megatron.grouped_experts import GroupedExperts

log = logging.getLogger(__name__)

class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm whose weight is tagged for the TP grad all-reduce of sequence parallel."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError("model: the sequence-parallel local norm is plain RMSNorm only")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def _swap(node: Any, old: type, new: type, seen: set[int]) -> Any:
    """`node` with every reference to class `old` inside specs/submodule dataclasses -> `new`."""
    if node is old:
        return new
    if id(node) in seen:
        return node
    seen.add(id(node))
    if isinstance(node, list):
        return [_swap(x, old, new, seen) for x in node]
    if isinstance(node, functools.partial):  # MoE specs are partials of MoELayer/SequentialMLP
        func, args = _swap(node.func, old, new, seen), [_swap(x, old, new, seen) for x in node.args]
        kw = {k: _swap(v, old, new, seen) for k, v in node.keywords.items()}
        if func is node.func and all(a is b for a, b in zip(args, node.args, strict=True)) \
                and all(kw[k] is v for k, v in node.keywords.items()):
            return node
        return functools.partial(func, *args, **kw)
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            swapped = _swap(value, old, new, seen)
            if swapped is not value:
                object.__setattr__(node, f.name, swapped)
    return node


def decoder_spec(tcfg: Any, fam: Any = None, experts: str = "sequential",
                 attention: str = "unfused", planned_dispatch: bool = False,
                 gather_permute: bool = False) -> Any:
    """megatron's local GPT decoder block spec for `tcfg` (norms SP-capable when SP is on) and
    the family `fam` (a families.FamilyArch: OLMoE's full-width QK-norm; GPT-OSS's sinks and
    expert biases follow `tcfg`); `experts` grouped / `attention` sdpa put the fast path's
    modules in the experts and core-attention slots (model.experts / model.attention);
    `planned_dispatch` puts PlannedMoELayer in the MoE layer's (model.planned_dispatch),
    `gather_permute` its GatherMoELayer subclass (model.moe_permute: gather)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization="RMSNorm")
    if tcfg.multi_latent_attention:  # the local spec's MLA gaps (family_deepseek_v3)
        from trainer.megatron.family_deepseek_v3 import mla_spec

        spec = mla_spec(copy.deepcopy(spec), tcfg)
    if tcfg.sequence_parallel:
        # a copy: megatron may hand out shared spec objects
        spec = _swap(copy.deepcopy(spec), WrappedTorchNorm, SequenceParallelRMSNorm, set())
    if fam is not None and fam.full_qk_norm:
        from trainer.megatron.family_olmoe import full_width_qk_norm

        spec = full_width_qk_norm(copy.deepcopy(spec))
    if tcfg.softmax_type == "learnable" or (tcfg.add_bias_linear and tcfg.num_moe_experts):
        from trainer.megatron.family_gpt_oss import swap_modules

        spec = swap_modules(copy.deepcopy(spec), tcfg, lambda s, old, new: _swap(s, old, new, set()))
    return fast_path(spec, tcfg, experts, attention, planned_dispatch, gather_permute)


def fast_path(spec: Any, tcfg: Any, experts: str, attention: str,
              planned_dispatch: bool = False, gather_permute: bool = False) -> Any:
    """`spec` with GroupedExperts for megatron's SequentialMLP (experts: grouped), where the
    family's attention allows it, SdpaAttention for the plain DotProductAttention (attention:
    sdpa; GPT-OSS's sink attention and MLA's keep theirs: they are other classes), and
    PlannedMoELayer for MoELayer (planned_dispatch; its GatherMoELayer subclass with
    gather_permute, which needs planned_dispatch)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    if gather_permute and not planned_dispatch:
        raise ValueError("model.moe_permute: gather needs model.planned_dispatch on (its "
                         "dispatcher is the planned one's subclass)")
    if planned_dispatch and tcfg.num_moe_experts:
        from trainer.megatron.gather_permute import GatherMoELayer  # imports megatron
        from trainer.megatron.planned_dispatch import PlannedMoELayer

        layer = GatherMoELayer if gather_permute else PlannedMoELayer
        spec = _swap(copy.deepcopy(spec), MoELayer, layer, set())

    if experts == "grouped" and tcfg.num_moe_experts:
        spec = _swap(copy.deepcopy(spec), SequentialMLP, GroupedExperts, set())
    if attention == "sdpa" and applies(tcfg):
        spec = _swap(copy.deepcopy(spec), DotProductAttention, SdpaAttention, set())
    elif attention == "sdpa":
        log.info("model.attention: sdpa does not apply to this family (sinks, sliding window "
                 "or MLA): its DotProductAttention runs")
    return spec
