"""GPT-OSS (HF `model_type` gpt_oss) on megatron-core 0.19's local spec: options and weights.

What GPT-OSS brings, and the megatron-core option that computes the same thing (set by
`families.config_overrides` from the FamilyArch `gpt_oss_arch` builds):
  * attention sinks: HF `self_attn.sinks` [heads], one logit per head appended to every softmax
    row (unscaled) and dropped after it == DotProductAttention's `core_attention.softmax_offset`
    (softmax_type "learnable"; SoftmaxOne appends it as the last column; same [heads] layout);
  * alternating sliding-window / full attention: HF `layer_types` and `sliding_window` W (query i
    sees keys j with i - W < j <= i) == megatron window_size (W - 1, 0) and the per-layer list
    window_attn_skip_freq (1 = sliding). The local attention builds that mask itself and ignores
    the mask passed in, which is right for the trainer's batches: one sample per row, right-
    padded (trainer.samples.batch), so pads never precede a real token and nothing is packed;
  * experts: HF `gate_up_proj` [E, H, 2I] applied as x @ W, gate = columns 0::2, up = 1::2, and
    `down_proj` [E, I, H], each with a bias; the activation is
    (clamp(up, -c, c) + 1) * g * sigmoid(1.702 g), g = min(gate, c) (c = swiglu_limit) ==
    megatron quick_gelu (x * sigmoid(1.702 x)) with glu_linear_offset 1 and
    activation_func_clamp_value c (megatron's unfused GLU clamps the gate half above, the linear
    half on both sides). megatron fc1 = [gate rows; up rows] [2I, H], fc2 [H, I];
  * biases on q/k/v/o, the router and the experts == add_bias_linear (megatron's Router then has
    its own bias parameter, the same logits bias as HF's `mlp.router.bias`);
  * router: softmax over the top-k logits (megatron non-pre-softmax), as Mixtral.
Refused by name: a swiglu_alpha other than quick_gelu's fixed 1.702, attention without biases,
layer types other than sliding/full attention, quantized (MXFP4) expert weights; expert tensor
parallelism is refused by `parallel.check_layout` (megatron-core keeps expert biases only at
expert_tensor_parallel 1).
Legend: E experts (El local), H hidden, I expert FFN width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer.megatron.family_arch import FamilyArch, WeightMapping

QUICK_GELU_ALPHA = 1.702  # megatron.core.fusions.fused_bias_geglu.quick_gelu's fixed gain
_KINDS = {"sliding_attention": True, "full_attention": False}


def gpt_oss_arch(cfg: dict) -> FamilyArch:
    """The FamilyArch of a GPT-OSS HF config; ValueError names a field megatron cannot build."""
    alpha = float(cfg.get("swiglu_alpha", QUICK_GELU_ALPHA))
    if alpha != QUICK_GELU_ALPHA:
        raise ValueError(f"swiglu_alpha: {alpha} - megatron-core 0.19's clamped GLU activation "
                         f"is quick_gelu, whose sigmoid gain is fixed at {QUICK_GELU_ALPHA}")
    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant:
        raise ValueError(f"quantization_config: {quant!r} experts (the published openai/gpt-oss "
                         "checkpoints are MXFP4) are not loaded by the megatron trainer; save a "
                         "bf16 copy first (transformers Mxfp4Config(dequantize=True))")
    if not cfg.get("attention_bias", True):
        raise ValueError("attention_bias: false - megatron's add_bias_linear (needed for the "
                         "router and expert biases) biases the attention projections too")
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(n)]
    if len(types) != n or any(t not in _KINDS for t in types):
        raise ValueError(f"layer_types: expected {n} of {', '.join(_KINDS)}, got {types}")
    window = int(cfg.get("sliding_window") or 0)
    sliding = tuple(_KINDS[t] for t in types)
    return FamilyArch(qkv_bias=True, qk_norm=False, renormalise=True, linear_bias=True,
                      attn_sinks=True, window=window if any(sliding) else 0,
                      window_layers=sliding if window else (),
                      glu_clamp=float(cfg.get("swiglu_limit", 7.0)), fused_experts=True,
                      mapping=_MAPPING)


def layer_to_megatron(sd: dict, hf: str, mc: str, experts: range) -> dict[str, torch.Tensor]:
    """Output-projection bias, sinks, router and `experts` (global ids, renumbered from 0) of
    HF layer `hf` under the megatron layer prefix `mc`."""
    moe, ex = f"{hf}.mlp", f"{hf}.mlp.experts"
    out = {f"{mc}.self_attention.linear_proj.bias": sd[f"{hf}.self_attn.o_proj.bias"],
           f"{mc}.self_attention.core_attention.softmax_offset": sd[f"{hf}.self_attn.sinks"],
           f"{mc}.mlp.router.weight": sd[f"{moe}.router.weight"],
           f"{mc}.mlp.router.bias": sd[f"{moe}.router.bias"]}
    gate_up, gate_up_b = sd[f"{ex}.gate_up_proj"], sd[f"{ex}.gate_up_proj_bias"]
    down, down_b = sd[f"{ex}.down_proj"], sd[f"{ex}.down_proj_bias"]
    for local, e in enumerate(experts):
        p = f"{mc}.mlp.experts.local_experts.{local}"
        w = gate_up[e]  # [H, 2I]: x @ w; gate/up interleaved along the columns
        out |= {f"{p}.linear_fc1.weight": torch.cat([w[:, 0::2].t(), w[:, 1::2].t()], 0),
                f"{p}.linear_fc1.bias": torch.cat([gate_up_b[e, 0::2], gate_up_b[e, 1::2]]),
                f"{p}.linear_fc2.weight": down[e].t(), f"{p}.linear_fc2.bias": down_b[e]}
    return {k: v.contiguous() for k, v in out.items()}


def layer_to_hf(sd: dict, mc: str, hf: str, experts: range) -> dict[str, torch.Tensor]:
    """Inverse of `layer_to_megatron`; the fused expert tensors hold `experts` only (all of
    them for the export, which gathers the experts first)."""
    moe, ex = f"{hf}.mlp", f"{hf}.mlp.experts"
    out = {f"{hf}.self_attn.o_proj.bias": sd[f"{mc}.self_attention.linear_proj.bias"],
           f"{hf}.self_attn.sinks": sd[f"{mc}.self_attention.core_attention.softmax_offset"],
           f"{moe}.router.weight": sd[f"{mc}.mlp.router.weight"],
           f"{moe}.router.bias": sd[f"{mc}.mlp.router.bias"]}
    parts: dict[str, list[torch.Tensor]] = {"gate_up_proj": [], "gate_up_proj_bias": [],
                                            "down_proj": [], "down_proj_bias": []}
    for local in range(len(experts)):
        p = f"{mc}.mlp.experts.local_experts.{local}"
        gate, up = sd[f"{p}.linear_fc1.weight"].chunk(2, 0)  # [I, H] each
        gate_b, up_b = sd[f"{p}.linear_fc1.bias"].chunk(2, 0)
        parts["gate_up_proj"].append(torch.stack([gate.t(), up.t()], -1).flatten(-2))
        parts["gate_up_proj_bias"].append(torch.stack([gate_b, up_b], -1).flatten())
        parts["down_proj"].append(sd[f"{p}.linear_fc2.weight"].t())
        parts["down_proj_bias"].append(sd[f"{p}.linear_fc2.bias"])
    return out | {f"{ex}.{k}": torch.stack(v).contiguous() for k, v in parts.items()}


_MAPPING = WeightMapping(experts_to_megatron=layer_to_megatron, experts_to_hf=layer_to_hf)


def _tag_sinks(attn: Any) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    offset = getattr(attn, "softmax_offset", None)
    if isinstance(offset, torch.nn.Parameter) and not hasattr(offset, "tensor_model_parallel"):
        set_tensor_model_parallel_attributes(offset, True, 0, 1)


def swap_modules(spec: Any, tcfg: Any, swap: Callable[[Any, type, type], Any]) -> Any:
    """The local decoder spec with GPT-OSS's two module subclasses (`swap(spec, old, new)`
    replaces a class everywhere in the spec):
      * learnable sinks: DotProductAttention whose `softmax_offset` (this rank's heads) carries
        the tensor-parallel attributes megatron's sharded state dict gives it (partition dim 0):
        the weight load slices it per TP rank and the grad norm counts every rank's heads;
      * expert biases: megatron's MLP adds an expert's fc2 bias in place into fc2's output
        (`output += output_bias * per_token_scale`, megatron.core.transformer.mlp.MLP.forward);
        with one expert-TP rank and no EP that output is what the identity TP all-reduce Function
        returned as-is, and autograd refuses the in-place add in training. The expert fc2 here
        hands back a copy then. And RowParallelLinear tags its bias `sequence_parallel` (summed
        over TP by finalize_model_grads), but an expert's grads are already reduced over the
        expert-data-parallel group, which spans the TP ranks at expert_tensor_parallel 1 (the
        only size megatron-core allows expert biases at): the expert fc2 bias is untagged, or
        TP > 1 would count its gradient TP times."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SinkDotProductAttention(DotProductAttention):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            _tag_sinks(self)

    class ExpertBiasRowParallelLinear(RowParallelLinear):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.is_expert and self.bias is not None:
                self.bias.sequence_parallel = False  # type: ignore[attr-defined]

        def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, bias = super().forward(input_)
            if self.is_expert and bias is not None and not self.explicit_expert_comm:
                out = out.clone()
            return out, bias

    if tcfg.softmax_type == "learnable":
        spec = swap(spec, DotProductAttention, SinkDotProductAttention)
    if tcfg.add_bias_linear and tcfg.num_moe_experts:
        spec = swap(spec, RowParallelLinear, ExpertBiasRowParallelLinear)
    return spec
