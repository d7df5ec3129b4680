"""Grouped-GEMM routed experts for megatron-core 0.19's experts slot (model.experts: grouped).

`GroupedExperts` replaces the local spec's `SequentialMLP` (a Python loop of two linears per
local expert) with two stacked weights, `linear_fc1.weight` [El, 2F, H] (each expert's
[gate; up], megatron's fc1 layout) and `linear_fc2.weight` [El, H, F], and one grouped matrix
product per projection over the dispatcher's tokens (already sorted by local expert, with
`tokens_per_expert` counts): `torch._grouped_mm` on CUDA in bf16. Elsewhere (CPU, fp32) it runs
a loop of `F.linear` over the same stacked weights, the same arithmetic as SequentialMLP's MLPs
in the same order, so the CPU suite checks the same module bit for bit against the plain path.
The router (and with it routing replay) runs before the experts and is untouched.

Weights: r3flow names experts in the SequentialMLP layout (`...experts.local_experts.N.
linear_fc{1,2}.weight`; hf_mapping, old checkpoints); `stack_experts` / `unstack_experts`
convert between that layout and this module's stacked one, so HF load/export and old
checkpoints go through the per-expert names unchanged.
Limits (refused at build, naming the field): expert biases (GPT-OSS), expert tensor parallel
> 1, moe_apply_probs_on_input.
Legend: T dispatched tokens, H hidden, F expert FFN width, El local experts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F

_SEQ = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12]\.weight)$")


class _Stacked(torch.nn.Module):
    """One projection of every local expert: `weight` [El, out, in] (megatron's [out, in])."""

    def __init__(self, experts: int, out: int, inp: int, config: Any, init: Any,
                 allreduce: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(experts, out, inp, dtype=config.params_dtype))
        if config.perform_initialization:
            with torch.no_grad():
                for w in self.weight:
                    init(w)
        # what megatron's expert linears carry: reduced over the expert-DP group when experts
        # are spread (ColumnParallelLinear's use_expert_pgs); never a TP duplicate (ETP 1)
        self.weight.allreduce = allreduce  # type: ignore[attr-defined]
        self.weight.tensor_model_parallel = False  # type: ignore[attr-defined]

    def forward(self) -> torch.Tensor:
        """The stacked weight. Called, not read: with optim.overlap_param_gather megatron DDP
        finishes a parameter's all-gather in the forward pre-hook of the module that holds it,
        so reading `linear_fcK.weight` from the parent would see the previous step's shards."""
        return self.weight


class GroupedExperts(torch.nn.Module):
    """megatron ExpertsInterface: forward(tokens [T, H], tokens_per_expert [El], probs [T])."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any = None,
                 pg_collection: Any = None, name: str | None = None) -> None:
        super().__init__()
        _check(config, pg_collection)
        self.config, self.num_local_experts = config, num_local_experts
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        allreduce = not (config.expert_model_parallel_size > 1
                         or config.expert_tensor_parallel_size != config.tensor_model_parallel_size)
        self.linear_fc1 = _Stacked(num_local_experts, 2 * f if config.gated_linear_unit else f, h,
                                   config, config.init_method, allreduce)
        self.linear_fc2 = _Stacked(num_local_experts, h, f, config,
                                   config.output_layer_init_method, allreduce)

    def _act(self, x: torch.Tensor) -> torch.Tensor:
        """MLP's activation (megatron.core.transformer.mlp.MLP.forward, unfused branch)."""
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(x)
        gate, lin = torch.chunk(x, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            gate, lin = gate.clamp(min=None, max=val), lin.clamp(min=-val, max=val)
        return c.activation_func(gate) * (lin + c.glu_linear_offset)

    def _scaled(self, fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return (self._act(fc1) * probs.unsqueeze(-1)).to(fc1.dtype)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        w1, w2 = self.linear_fc1(), self.linear_fc2()  # pre-hooks: see _Stacked.forward
        if use_grouped_mm(tokens):
            counts = tokens_per_expert.to(device=tokens.device, non_blocking=True)
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            fc1 = torch._grouped_mm(tokens, w1.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(self._scaled(fc1, probs), w2.transpose(-2, -1),
                                     offs=offs), None
        counts_list = [int(n) for n in tokens_per_expert.tolist()]
        outs = []
        for e, (x, p) in enumerate(zip(torch.split(tokens, counts_list),
                                       torch.split(probs, counts_list), strict=True)):
            outs.append(F.linear(self._scaled(F.linear(x, w1[e]), p), w2[e]))
        return torch.cat(outs, 0), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in backward (no delayed wgrad)."""


def use_grouped_mm(tokens: torch.Tensor) -> bool:
    """The grouped kernel runs: bf16 tokens on a CUDA device, at least one token."""
    return tokens.is_cuda and tokens.dtype == torch.bfloat16 and tokens.shape[0] > 0


def _check(config: Any, pg_collection: Any) -> None:
    if config.add_bias_linear:
        raise ValueError("model.experts: grouped experts have no biases (GPT-OSS); use "
                         "sequential")
    if config.expert_tensor_parallel_size != 1:
        raise ValueError(f"model.experts: grouped experts need expert_tensor_parallel 1, got "
                         f"{config.expert_tensor_parallel_size}")
    if config.moe_apply_probs_on_input or config.bias_activation_fusion:
        raise ValueError("model.experts: grouped experts apply probs after the activation, "
                         "unfused (moe_apply_probs_on_input/bias_activation_fusion off)")


# ---------------------------------------------------------------------- weight layouts
def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """SequentialMLP layout (`experts.local_experts.N.linear_fcK.weight`) -> stacked
    (`experts.linear_fcK.weight` [El, ...]); other names pass through."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _SEQ.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = t
    for name, per in groups.items():
        if sorted(per) != list(range(len(per))):
            raise ValueError(f"weights.{name}: local experts {sorted(per)} are not 0..{len(per) - 1}")
        out[name] = torch.stack([per[e] for e in range(len(per))])
    return out


def unstack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `stack_experts` (views of the stacked tensors)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        for e, w in enumerate(t.unbind(0)):
            out[f"{m.group(1)}.local_experts.{e}.{m.group(2)}"] = w
    return out


def to_layout_of(tensors: dict[str, torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """`tensors` in the expert layout the model with parameter `names` uses (either way)."""
    if any(_STACKED.match(n) for n in names):
        return stack_experts(tensors)
    return unstack_experts(tensors)
