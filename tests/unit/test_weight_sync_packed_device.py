"""A packed bucket made on another device than the wire's (a GPU trainer pushing over gloo, as
`r3flow local` on one GPU does) is copied to the wire's device before it is laid out and sent."""

from __future__ import annotations

import torch

from services.common.weight_sync import buckets as bk
from services.common.weight_sync.layout import PackedLayout


def test_packed_bucket_is_moved_to_the_wire_device():
    entry = bk.TensorEntry("w", torch.bfloat16, (64,), 0, 128)
    buf = torch.arange(128, dtype=torch.uint8)
    layout = PackedLayout()
    # meta stands in for "not the producer's device" on a CPU-only box
    (laid, sources), = layout.stream([bk.PackedBucket((entry,), buf)], torch.device("meta"))
    assert laid.direct and sources[0].device.type == "meta" and sources[0].numel() == 128
    # same device: sent as it is, no copy
    (_, same), = PackedLayout().stream([bk.PackedBucket((entry,), buf)], torch.device("cpu"))
    assert same[0] is buf
