"""Small decisions all trainer ranks take together (all-reduces over the world group)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: int) -> int:
    """The largest `value` of all trainer ranks (an all-reduce over the world group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True if `flag` is set on any trainer rank (an all-reduce over the world group)."""
    return bool(max_over_ranks(int(flag)))
