"""Logits made in [B, S, V] order (model.batch_first_logits, issue 44): no copy of the logits.

megatron-core 0.19's GPTModel computes the output layer on the decoder's [S, B, H] hidden states
and, with no labels (the trainer computes its own loss), returns
`logits.transpose(0, 1).contiguous()`: a copy of the whole [S, B, V] logits in forward (2.5 GB
of bf16 for 2 x 4,096 tokens of a 151,936 vocabulary) and another of their gradient in backward.
The one-H200 profile of the fast path put the two at 6.3 ms of a 0.28 s step
(docs/benchmarks/megatron-parallel.md, issue 44).

`BatchFirstGPTModel` is megatron's GPTModel whose output layer is a `BatchFirstOutputLayer`:
megatron's ColumnParallelLinear, built with the constructor arguments GPTModel gives its own,
whose forward takes the hidden states as [B, S, H] (a copy of the hidden states: V / H = 74 x
smaller for Qwen3-MoE) and hands back the transposed view of its [B, S, V] result, so megatron's
`transpose(0, 1).contiguous()` is the [B, S, V] tensor itself. Nothing is rebound on an
instance: GPTModel picks its output layer's class itself (no spec entry), so the subclass builds
its own in place of the one GPTModel built (model build time only: one more init of a [V, H]
weight, which the checkpoint then overwrites).
Every logit is the same dot product of the same row of weights and the same hidden vector; the
weight gradient sums the tokens in [B, S] instead of [S, B] order (equal in exact arithmetic).
Only where the output layer does not gather the sequence (sequence_parallel off: TP 1): with
sequence parallel its input is split on the sequence dimension, which must stay first; nor with
tied embeddings or megatron's MXFP8 (Transformer Engine) LM head, which r3flow does not build.
Legend: S sequence, B batch, H hidden, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel import ColumnParallelLinear

FIELD = "model.batch_first_logits"


class BatchFirstOutputLayer(ColumnParallelLinear):
    """megatron's output layer computed on [B, S, H]: its [B, S, V] result returned as the
    [S, B, V] view GPTModel expects."""

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, Any]:
        logits_BSV, bias = super().forward(input_.transpose(0, 1).contiguous(), weight=weight,
                                           runtime_gather_output=runtime_gather_output)
        return logits_BSV.transpose(0, 1), bias


class BatchFirstGPTModel(GPTModel):
    """GPTModel whose last stage's output layer is a `BatchFirstOutputLayer` (same arguments
    as GPTModel's own). ValueError naming the field where it cannot apply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self.post_process:  # no output layer on this pipeline stage
            return
        layer = self.output_layer  # type: ignore[has-type]
        why = ("sequence_parallel off (the output layer's input is split on the sequence "
               "dimension)" if layer.sequence_parallel else
               "untied output weights" if self.share_embeddings_and_output_weights else
               "megatron's ColumnParallelLinear output layer"
               if type(layer) is not ColumnParallelLinear else None)
        if why:
            raise ValueError(f"{FIELD}: needs {why}")
        self.output_layer = BatchFirstOutputLayer(
            self.config.hidden_size, self.vocab_size, config=self.config,
            init_method=self.config.init_method, bias=False, skip_bias_add=False,
            gather_output=not self.parallel_output, skip_weight_param_allocation=False,
            embedding_activation_buffer=self.embedding_activation_buffer,
            grad_output_buffer=self.grad_output_buffer, tp_group=self.pg_collection.tp)
        self.setup_embeddings_and_output_layer()  # the parameter tags the new weight needs
