"""Bucket packing, unpacking and checksums of the weight push (no processes, no network)."""

from __future__ import annotations

import pytest
import torch

from services.common.pb.r3flow.v1 import store_pb2
from services.common.weight_sync import WeightSyncConfig, members_of, rank_in
from services.common.weight_sync import buckets as bk
from services.common.weight_sync import headers as hd
from services.common.weight_sync import sums as hs

CPU = torch.device("cpu")


def _model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(97, 33, generator=g)),  # odd sizes, fp32
        ("model.norm.weight", torch.randn(33, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.gate.weight", torch.randn(5, 33, generator=g).half()),
        ("lm_head.weight", torch.randn(300, 300, generator=g)),  # bigger than a bucket
        ("scale", torch.tensor(3.5, dtype=torch.float64)),  # 0-dim
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(11, dtype=torch.int64)),
        ("ids32", torch.arange(7, dtype=torch.int32) - 3),
        ("mask", torch.tensor([True, False, True])),
        ("bytes", torch.arange(13, dtype=torch.uint8)),
        ("transposed", torch.randn(6, 10, generator=g).t()),  # non-contiguous source
    ]


def _send_receive(named, bucket_bytes=4096, wire=torch.bfloat16, direct_min=1 << 30):
    """Pack every bucket, copy its bytes as a transport would, rebuild views on the far side."""
    out = {}
    specs = list(bk.iter_buckets(named, bucket_bytes, wire, CPU, direct_min))
    for spec in specs:
        buf = torch.full((max(bucket_bytes, spec.nbytes),), 0xAB, dtype=torch.uint8)
        sent = bk.fill(buf, spec)
        entries = hs.with_checksums(spec.entries, hs.checksums(sent, spec.entries))
        head = hd.decode_header(hd.encode_header(spec.index, spec.nbytes, entries))
        received = sent.clone()
        assert hs.verify(received, head["tensors"]) == []
        views = bk.bucket_views(received, head["tensors"])
        assert all(torch.equal(v, bk.tensor_view(received, e))
                   for v, e in zip(views, head["tensors"], strict=True))
        out.update({e.name: v for e, v in zip(head["tensors"], views, strict=True)})
    return specs, out


def _expected(t: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    return t.to(wire) if t.dtype in bk.CAST_DTYPES else t


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float32])
def test_roundtrip_all_dtypes_and_shapes(wire):
    named = _model()
    specs, got = _send_receive(named, wire=wire)
    assert list(got) == [n for n, _ in named]
    for name, t in named:
        assert got[name].shape == t.shape, name
        assert got[name].dtype == _expected(t, wire).dtype, name
        assert torch.equal(got[name], _expected(t, wire)), name
    assert len(specs) > 2
    assert all(s.nbytes <= 4096 for s in specs if len(s.entries) > 1)


def test_tensor_bigger_than_bucket_gets_its_own_bucket():
    specs, _ = _send_receive(_model(), bucket_bytes=4096)
    big = [s for s in specs if any(e.name == "lm_head.weight" for e in s.entries)]
    assert len(big) == 1 and len(big[0].entries) == 1
    assert big[0].nbytes == bk.aligned(300 * 300 * 2)


def test_offsets_are_aligned_and_checksum_extents_disjoint():
    for spec in bk.iter_buckets(_model(), 4096, torch.bfloat16, CPU, 1 << 30):
        ends = 0
        for e, (start, end) in zip(spec.entries, bk.extents(spec.entries, spec.nbytes),
                                   strict=True):
            assert e.offset % bk.ALIGN == 0 and start == e.offset >= ends
            assert e.offset + e.nbytes <= end and end % 8 == 0
            ends = end
        assert spec.nbytes == ends  # the bucket is exactly its extents (whole rows if several)


def test_direct_send_is_zero_copy():
    w = torch.randn(64, 64).to(torch.bfloat16)
    small = torch.randn(3)
    specs = list(bk.iter_buckets([("s", small), ("w", w)], 1 << 20, torch.bfloat16, CPU, 4096))
    assert [len(s.entries) for s in specs] == [1, 1]
    assert specs[0].direct is None and specs[1].direct is not None
    sent = bk.fill(torch.empty(1 << 20, dtype=torch.uint8), specs[1])
    assert sent.data_ptr() == w.data_ptr()
    # a cast is needed for fp32: packed, not direct
    spec = next(bk.iter_buckets([("w", w.float())], 1 << 20, torch.bfloat16, CPU, 4096))
    assert spec.direct is None


def test_checksum_catches_a_flipped_byte_in_the_right_tensor():
    named = [("a", torch.randn(10, 10)), ("b", torch.randn(7)), ("c", torch.arange(5))]
    spec = next(bk.iter_buckets(named, 1 << 20, torch.bfloat16, CPU, 1 << 30))
    sent = bk.fill(torch.zeros(1 << 20, dtype=torch.uint8), spec)
    entries = hs.with_checksums(spec.entries, hs.checksums(sent, spec.entries))
    corrupt = sent.clone()
    corrupt[entries[1].offset + 3] ^= 0x10
    assert hs.verify(corrupt, entries) == ["b"]
    assert hs.verify(sent, entries) == []
    # the end-of-push form: per-bucket checksum tensors against the sender's lists
    want = hs.split_sums([bk.checksum_tensor(sent, spec.entries)])
    got = hs.split_sums([bk.checksum_tensor(corrupt, spec.entries)])
    assert hs.mismatches([spec.entries], got, want) == ["b"]
    assert hs.mismatches([spec.entries], want, want) == []


def test_checksum_is_wrapping_int64_word_sum():
    t = torch.tensor([2**62, 2**62, 2**62, 1], dtype=torch.int64)
    entry = bk.TensorEntry("t", torch.int64, (4,), 0, 32)
    [s] = hs.checksums(t.view(torch.uint8), [entry])
    assert s == (3 * 2**62 + 1) % 2**64 - 2**64  # wrapped into a signed int64


def test_gpu_segment_sums_equal_per_tensor_sums():
    """The prefix-sum form used on CUDA gives the same wrapped sums (run here on CPU)."""
    spec = next(bk.iter_buckets(_model()[:3] + _model()[4:], 1 << 20, torch.bfloat16, CPU,
                                1 << 30))
    sent = bk.fill(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8), spec)
    assert len(spec.entries) > 5
    assert bk._segment_sums(sent, spec.entries).tolist() == hs.checksums(sent, spec.entries)


def test_header_roundtrip_and_end_marker():
    e = bk.TensorEntry("x.weight", torch.bfloat16, (2, 3), 64, 12, -5)
    head = hd.decode_header(hd.encode_header(4, 128, [e]))
    assert head["index"] == 4 and head["nbytes"] == 128 and head["tensors"] == [e]
    end = hd.decode_header(hd.encode_end(5, 17, 1024, [[1, -2], [3]]))
    assert end == {"end": True, "buckets": 5, "tensors": 17, "bytes": 1024,
                   "sums": [[1, -2], [3]]}


def test_bad_input_errors_name_the_field():
    with pytest.raises(ValueError, match="wire_dtype"):
        bk.wire_dtype("int8")
    with pytest.raises(TypeError, match="weights\\['x'\\]"):
        list(bk.iter_buckets([("x", [1, 2])], 1024, torch.bfloat16, CPU, 1024))
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bk.iter_buckets([], 8, torch.bfloat16, CPU, 8))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        WeightSyncConfig(heartbeat_timeout_s=0.3, heartbeat_interval_s=0.25)
    with pytest.raises(ValueError, match="device"):
        WeightSyncConfig(backend="nccl", device="cpu")
    assert WeightSyncConfig().resolved_bucket_bytes() == 64 << 20
    assert WeightSyncConfig(backend="nccl", device="cuda").resolved_bucket_bytes() == 1 << 30


def test_ranks_follow_plan_order_and_worker_world_size():
    plan = store_pb2.WeightSyncPlan(version=3, members=[
        store_pb2.WorkerInfo(worker_id="a", world_size=1),
        store_pb2.WorkerInfo(worker_id="b", world_size=2),
        store_pb2.WorkerInfo(worker_id="c", world_size=1)])
    assert [(m.worker_id, m.local_rank, m.rank) for m in members_of(plan)] == [
        ("a", 0, 1), ("b", 0, 2), ("b", 1, 3), ("c", 0, 4)]
    assert str(rank_in(plan, "b", 1)) == "b[1] (rank 3)"
    with pytest.raises(ValueError, match="worker_id"):
        rank_in(plan, "z")
