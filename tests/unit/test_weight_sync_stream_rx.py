"""Streamed receive (weight_sync.receiver_stream): tensors handed over bucket by bucket as they
land, through a ring of a few staging buffers, over two pushes (listed and streamed layouts),
verified and committed like `receive`; an abort raises through the loader."""

from __future__ import annotations

import threading

import pytest
import torch

from services.common.net import free_port
from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import (
    WeightReceiver,
    WeightSender,
    WeightSyncConfig,
    WeightSyncError,
)
from services.common.weight_sync import buckets as bk
from services.common.weight_sync.receiver_stream import staged_bytes, stream_weights

BUCKET = 1 << 12


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    named = [(f"model.layers.{i}.mlp.experts.{e}.up_proj.weight", torch.randn(24, 16, generator=g))
             for i in range(8) for e in range(8)]
    return named + [("lm_head.weight", torch.randn(32, 64, generator=g))]


def _load(rx: WeightReceiver, plan, out: dict) -> None:
    """A loader that copies each tensor as it comes (as vLLM's weight loaders do)."""
    try:
        out["got"] = {n: t.clone() for n, t in stream_weights(rx, plan)}
        out["staged"] = staged_bytes(rx)
    except WeightSyncError as e:
        out["error"] = e


def test_streamed_receive_loads_each_push_with_a_bounded_ring():
    sender = WeightSender(WeightSyncConfig(bucket_bytes=BUCKET, timeout_s=10,
                                           heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0))
    rx = WeightReceiver("a")
    try:
        for version in (1, 2):
            named = _weights(version)
            plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                              world_size=1)])
            out: dict = {}
            t = threading.Thread(target=_load, args=(rx, plan, out))
            t.start()
            report = sender.push(plan, iter(named) if version == 1 else dict(named))
            t.join()
            assert "error" not in out, out.get("error")
            assert set(out["got"]) == {n for n, _ in named}
            for name, want in named:
                assert torch.equal(out["got"][name], want.to(torch.bfloat16)), name
            model = sum(w.numel() * 2 for _, w in named)
            assert report.num_buckets > 6
            # 3 slots of at most a bucket each (no tensor is bigger), not the model
            assert out["staged"] <= 3 * BUCKET < model
    finally:
        sender.close()


def test_streamed_pushes_reuse_the_last_streams_buckets_while_they_fit():
    """A generator input lays out only what changed: the same stream again reuses every
    bucket, a tensor of another shape relays the buckets from its own on; receivers get the
    right tensors each time."""
    sender = WeightSender(WeightSyncConfig(bucket_bytes=BUCKET, timeout_s=10,
                                           heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0))
    rx = WeightReceiver("a")
    g = torch.Generator().manual_seed(3)
    named = _weights(1)
    changed = list(named)
    changed[40] = (changed[40][0], torch.randn(12, 16, generator=g))
    try:
        reused = []
        for version, weights in ((1, named), (2, named), (3, changed)):
            plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                              world_size=1)])
            out: dict = {}
            t = threading.Thread(target=_load, args=(rx, plan, out))
            t.start()
            report = sender.push(plan, iter(weights))
            t.join()
            assert "error" not in out, out.get("error")
            for name, want in weights:
                assert torch.equal(out["got"][name], want.to(torch.bfloat16)), (version, name)
            reused.append((sender._streamed.reused, report.num_buckets))
        assert reused[0][0] == 0 and reused[1][0] == reused[1][1]  # all reused the 2nd time
        assert 0 < reused[2][0] < reused[2][1]  # the buckets before the changed tensor
    finally:
        sender.close()


def _packed(named: list[tuple[str, torch.Tensor]], per: int) -> list[bk.PackedBucket]:
    """`named` cut into packed buckets of `per` tensors (bf16 on the wire), as the trainer's
    streamed export packs its chunks."""
    out = []
    for i in range(0, len(named), per):
        entries, pos = [], 0
        for name, t in named[i: i + per]:
            offset = bk.aligned(pos)
            entries.append(bk.TensorEntry(name, torch.bfloat16, tuple(t.shape), offset,
                                          t.numel() * 2))
            pos = offset + t.numel() * 2
        buf = torch.zeros(bk.aligned(pos), dtype=torch.uint8)
        for e, (_, t) in zip(entries, named[i: i + per], strict=True):
            bk.tensor_view(buf, e).copy_(t)
        out.append(bk.PackedBucket(tuple(entries), buf))
    return out


def test_packed_buckets_are_sent_as_they_are_and_their_headers_reused():
    """A stream of packed buckets (the trainer's chunks) goes on the wire bucket for bucket;
    the same entries again reuse every header; a bucket with other entries is laid out anew;
    a tensor among packed buckets is refused naming its position."""
    sender = WeightSender(WeightSyncConfig(bucket_bytes=BUCKET, timeout_s=10,
                                           heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0))
    rx = WeightReceiver("a")
    named = _weights(5)
    packed = _packed(named, 7)
    changed = list(packed)
    changed[3] = _packed(named[21:28], 3)[0]  # fewer tensors in bucket 3: the rest shift
    try:
        laid = []
        for version, buckets in ((1, packed), (2, packed), (3, changed)):
            plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                              world_size=1)])
            out: dict = {}
            t = threading.Thread(target=_load, args=(rx, plan, out))
            t.start()
            report = sender.push(plan, iter(buckets))
            t.join()
            assert "error" not in out, out.get("error")
            sent = {e.name for b in buckets for e in b.entries}
            assert set(out["got"]) == sent and report.num_buckets == len(buckets)
            for name, want in named:
                if name in sent:
                    assert torch.equal(out["got"][name], want.to(torch.bfloat16)), name
            laid.append([id(lb) for _, lb in sender._packed._laid])
        assert laid[0] == laid[1]  # the same entries: every header reused
        assert laid[2][:3] == laid[0][:3] and laid[2][3] != laid[0][3]
        plan = sender.plan(4, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                    world_size=1)])
        out = {}
        t = threading.Thread(target=_load, args=(rx, plan, out))
        t.start()
        with pytest.raises(TypeError, match="item 1 is a tuple"):
            sender.push(plan, iter([packed[0], named[9]]))
        t.join()
        assert isinstance(out.get("error"), WeightSyncError)  # the receiver was told
    finally:
        sender.close()


def test_a_packed_bucket_must_be_whole_rows_of_bytes():
    entry = bk.TensorEntry("w", torch.bfloat16, (4,), 0, 8)
    with pytest.raises(ValueError, match="buffer: a packed bucket is flat uint8"):
        bk.PackedBucket((entry,), torch.zeros(60, dtype=torch.uint8))
    with pytest.raises(ValueError, match="entries: 'w' ends past"):
        bk.PackedBucket((bk.TensorEntry("w", torch.bfloat16, (64,), 0, 128),),
                        torch.zeros(64, dtype=torch.uint8))


def test_a_sender_restarted_at_the_same_address_is_joined_afresh():
    """A trainer restarted on the same node and port (KubeRay's retry at the old pod IP): the
    receiver's connection to the old sender's store is broken, so the next push reconnects
    instead of failing on it for good (make test-cluster: 'Broken pipe' on every push after)."""
    port = free_port()
    cfg = WeightSyncConfig(bucket_bytes=BUCKET, timeout_s=10, port=port,
                           heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0)
    rx = WeightReceiver("a")
    for version in (1, 2):
        sender = WeightSender(cfg)
        try:
            named = _weights(version)
            plan = sender.plan(version, [store_pb2.WorkerInfo(worker_id="a", host="127.0.0.1",
                                                              world_size=1)])
            assert plan.master_port == port
            out: dict = {}
            t = threading.Thread(target=_load, args=(rx, plan, out))
            t.start()
            sender.push(plan, iter(named))
            t.join()
            assert "error" not in out, out.get("error")
            assert torch.equal(out["got"][named[0][0]], named[0][1].to(torch.bfloat16))
        finally:
            sender.close()
