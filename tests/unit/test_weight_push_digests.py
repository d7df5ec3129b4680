"""The export digests the cluster test compares with the engines' (trainer.weight_push.digesting)
are the same whether the sender takes tensors or the export's packed buckets."""

from __future__ import annotations

import torch

from services.common.weight_sync import buckets as bk
from services.common.weight_sync.config import WeightSyncConfig
from trainer.weight_push import digesting


def test_digests_of_packed_buckets_equal_those_of_the_tensors():
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(3 + i, 5, generator=g)) for i in range(6)]
    entries, pos = [], 0
    for name, t in named:
        offset = bk.aligned(pos)
        entries.append(bk.TensorEntry(name, torch.bfloat16, tuple(t.shape), offset, t.numel() * 2))
        pos = offset + t.numel() * 2
    buf = torch.zeros(bk.aligned(pos), dtype=torch.uint8)
    for e, (_, t) in zip(entries, named, strict=True):
        bk.tensor_view(buf, e).copy_(t)
    packed = bk.PackedBucket(tuple(entries), buf)
    cfg = WeightSyncConfig(wire_dtype="bfloat16")
    from_tensors: dict[str, str] = {}
    from_packed: dict[str, str] = {}
    assert list(digesting(cfg, iter(named), from_tensors)) == named  # passed through
    assert list(digesting(cfg, iter([packed]), from_packed)) == [packed]
    assert from_packed == from_tensors and len(from_tensors) == len(named)
