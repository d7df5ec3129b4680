"""Logits made in [B, S, V] order (model.batch_first_logits, issue 44): no copy of the logits.

megatron-core 0.19's GPTModel computes the output layer on the decoder's [S, B, H] hidden states
and, with no labels (the trainer computes its own loss), returns
`logits.transpose(0, 1).contiguous()`: a copy of the whole [S, B, V] logits in forward (2.5 GB
of bf16 for 2 x 4,096 tokens of a 151,936 vocabulary) and another of their gradient in backward.
The one-H200 profile of the fast path put the two at 6.3 ms of a 0.28 s step
(docs/benchmarks/megatron-parallel.md, issue 44).

`batch_first_output` makes the output layer take the hidden states as [B, S, H] (a copy of the
hidden states: V / H = 74 x smaller for Qwen3-MoE) and hand back the transposed view of its
[B, S, V] result, so megatron's `transpose(0, 1).contiguous()` is the [B, S, V] tensor itself.
Every logit is the same dot product of the same row of weights and the same hidden vector; the
weight gradient sums the tokens in [B, S] instead of [S, B] order (equal in exact arithmetic).
Only where the output layer does not gather the sequence (sequence_parallel off: TP 1): with
sequence parallel its input is split on the sequence dimension, which must stay first.
Legend: S sequence, B batch, H hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

FIELD = "model.batch_first_logits"


def applies(module: torch.nn.Module) -> bool:
    """This rank's GPTModel has an output layer (last pipeline stage) without sequence
    parallelism."""
    layer = getattr(module, "output_layer", None)
    return layer is not None and not layer.sequence_parallel


def batch_first_output(module: torch.nn.Module) -> bool:
    """Make `module.output_layer` (megatron ColumnParallelLinear) compute [B, S, V] logits and
    return them as an [S, B, V] view; False where it does not apply (no output layer on this
    stage). ValueError naming the field with sequence parallelism."""
    layer = getattr(module, "output_layer", None)
    if layer is None:
        return False
    if layer.sequence_parallel:
        raise ValueError(f"{FIELD}: needs sequence_parallel off (the output layer's input is "
                         "split on the sequence dimension)")
    if isinstance(layer.forward, _BatchFirst):
        return True
    layer.forward = _BatchFirst(layer.forward)
    return True


class _BatchFirst:
    """The output layer's forward on [B, S, H]: its result transposed back to [S, B, V]."""

    def __init__(self, forward: Any) -> None:
        self.inner = forward

    def __call__(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                 runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, Any]:
        logits_BSV, bias = self.inner(input_.transpose(0, 1).contiguous(), weight=weight,
                                      runtime_gather_output=runtime_gather_output)
        return logits_BSV.transpose(0, 1), bias
