"""Fused causal core attention for megatron-core 0.19's core-attention slot (model.attention:
sdpa).

`SdpaAttention` takes the place of the local spec's `DotProductAttention` (which builds the full
[B, nh, S, S] score tensor, repeats K/V for GQA and softmaxes in torch): one
`F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` call, so CUDA picks a flash /
cuDNN / memory-efficient kernel and K/V are never repeated. Same inputs and output layout as
DotProductAttention ([S, B, heads, d] in, [S, B, heads*d] out), same softmax scale.
Families whose attention the kernel cannot express keep DotProductAttention (`applies`):
learnable sinks and sliding windows (GPT-OSS), MLA's own core attention (DeepSeek-V3).
On CPU the math kernel runs in the input dtype: an fp32 model matches DotProductAttention to
fp32 rounding (not bit for bit: the sum order differs).
Legend: S sequence, B batch, nh query heads per TP rank, ng KV groups per TP rank, d head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def applies(config: Any) -> bool:
    """SDPA can run this config's attention: no sinks, no sliding window, no MLA."""
    return (config.softmax_type == "vanilla" and config.window_size is None
            and not config.multi_latent_attention)


class SdpaAttention(torch.nn.Module):
    """megatron core attention: forward(q [S, B, nh, d], k/v [S, B, ng, d], mask) -> [S, B, nh*d]."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        from megatron.core.transformer.enums import AttnMaskType

        if not applies(config) or config.apply_query_key_layer_scaling:
            raise ValueError("model.attention: sdpa cannot run sinks, sliding windows, MLA or "
                             "query-key layer scaling; use unfused")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"model.attention: sdpa runs causal attention only, got "
                             f"{attn_mask_type}")
        if config.context_parallel_size != 1:
            raise ValueError("model.attention: sdpa has no context parallelism")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"model.attention: sdpa runs without attention dropout, got {dropout}")
        self.config = config
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None
                ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None or packed_seq_params:
            raise ValueError("model.attention: sdpa takes no attention mask, bias or packed "
                             "sequences (causal only)")
        s, b, nh, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [B, heads, S, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != nh)
        return out.permute(2, 0, 1, 3).reshape(s, b, nh * d)
