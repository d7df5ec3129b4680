"""Sequence parallelism for the HF backend (hf.sequence_parallel = P > 1): Ulysses attention.

The ranks form groups of P consecutive ranks; the ranks of a group train the same samples (the
union of the shares the loop gave them, as megatron's tensor-parallel peers do) and each runs
the model on its contiguous 1/P of every packed micro-batch row [1, T]. Everything but attention
is per token, so only attention needs the other ranks: `UlyssesAttention` (registered with
transformers' AttentionInterface under ATTN_NAME, the model built with that implementation)
all-to-alls q, k and v from [B, H, T/P, D] (all heads, my tokens) to [B, H/P, T, D] (my heads,
all tokens), runs SDPA with the block-diagonal causal mask of the whole packed row, and
all-to-alls the output back. The routers see this rank's tokens: the replay hook keeps this
rank's slice of each layer's rows (trainer.hf.routers.HFModelReplay.replay_forward).

The logits of the P slices are gathered along the sequence (`gather_sequence`: its backward
hands each rank the gradient of its own slice), so every rank of a group computes the same
loss over the whole row; the gradient each rank then reduces through FSDP2 is its tokens'
share, so the backend scales the loss by P to undo FSDP2's average over the group's ranks.
Legend: B batch rows (1: packed), H heads, Hkv key/value heads, T packed tokens, D head dim,
P sequence-parallel ranks, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

ATTN_NAME = "r3flow_ulysses"


def sp_groups(size: int) -> tuple[Any, int]:
    """(this rank's process group of `size` consecutive ranks, its rank in it); collective:
    every rank creates every group, as torch.distributed requires."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine, rank % size


def check_heads(config: Any, size: int) -> None:
    """ValueError naming hf.sequence_parallel when the heads do not split over `size` ranks
    (or the family's attention is not full causal); nothing to check without SP."""
    if size == 1:
        return
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv % size:
        raise ValueError(f"hf.sequence_parallel: {size} must divide the attention heads "
                         f"({heads}) and the key/value heads ({kv})")
    if getattr(config, "sliding_window", None) or getattr(config, "layer_types", None) and \
            any(t != "full_attention" for t in config.layer_types):
        raise ValueError("hf.sequence_parallel: sliding-window attention is not supported "
                         "(Ulysses attention here is full causal attention)")


def _heads_to_sequence(x_BHtD: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, H, T/P, D] (all heads, my tokens) -> [B, H/P, T, D] (my heads, all tokens)."""
    b, h, t, d = x_BHtD.shape
    send = x_BHtD.reshape(b, size, h // size, t, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [P(src), B, H/P, t, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _sequence_to_heads(x_BhTD: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[B, H/P, T, D] (my heads, all tokens) -> [B, H, T/P, D] (all heads, my tokens)."""
    b, h, n, d = x_BhTD.shape
    send = x_BhTD.reshape(b, h, size, n // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)  # [P(src), B, H/P, t, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, size * h, n // size, d)


def packed_causal_mask(position_ids_BT: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool: causal within each packed sample (positions restart at 0)."""
    seg_BT = torch.cumsum((position_ids_BT == 0).long(), dim=-1)
    same = seg_BT.unsqueeze(-1) == seg_BT.unsqueeze(-2)
    t = position_ids_BT.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=position_ids_BT.device).tril()
    return (same & causal).unsqueeze(1)


class UlyssesAttention:
    """The attention function of one sequence-parallel group (transformers calls it with this
    rank's q/k/v); `begin(position_ids)` before each forward gives it the whole row's mask."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size
        self.mask_B1TT: torch.Tensor | None = None

    def begin(self, position_ids_BT: torch.Tensor) -> None:
        self.mask_B1TT = packed_causal_mask(position_ids_BT)

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        if self.mask_B1TT is None:
            raise RuntimeError("sequence parallel attention: begin() was not called")
        q, k, v = (_heads_to_sequence(x, self.group, self.size) for x in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask_B1TT.to(q.device), dropout_p=dropout, scale=scaling,
            enable_gqa=k.shape[1] != q.shape[1])
        return _sequence_to_heads(out, self.group, self.size).transpose(1, 2).contiguous(), None


def register(attention: UlyssesAttention) -> None:
    """Make `attention` transformers' ATTN_NAME implementation in this process."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, attention)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 1 in the forward; the backward keeps this rank's slice (every rank
    of the group computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.size, ctx.rank = size, rank
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad.chunk(ctx.size, dim=1)[ctx.rank].contiguous(), None, None, None


def gather_sequence(x_BtV: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
    """[B, T/P, ...] of every rank of the group -> [B, T, ...] (rank order = sequence order)."""
    return _GatherSequence.apply(x_BtV, group, size, rank)


def gather_rows(rows_tK: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[T/P, K] recorded router rows of every rank of the group -> [T, K] (no grad)."""
    parts = [torch.empty_like(rows_tK) for _ in range(size)]
    dist.all_gather(parts, rows_tK.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def group_samples(samples: list, group: Any, size: int, rank: int) -> list:
    """The samples of this rank's group: the union, in rank order, of the shares the loop gave
    its ranks; this rank's own samples stay the same objects (callers map results by them)."""
    shares: list[Any] = [None] * size
    dist.all_gather_object(shares, list(samples), group=group)
    shares[rank] = list(samples)
    return [x for share in shares for x in share]
