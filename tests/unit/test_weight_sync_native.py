"""The C pack/checksum core of the CPU weight push against the torch reference path."""

from __future__ import annotations

import os

import pytest
import torch

from services.common.weight_sync import buckets as bk
from services.common.weight_sync import native

CPU = torch.device("cpu")


def _torch_sums(bucket_u8: torch.Tensor, entries: list[bk.TensorEntry]) -> list[int]:
    """The reference: one int64 reduction per extent."""
    return [int(bucket_u8[a:b].view(torch.int64).sum())
            for a, b in bk.extents(entries, bucket_u8.numel())]


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        ("bf16", torch.randn(37, 41, generator=g).to(torch.bfloat16)),  # copied byte for byte
        ("fp32_cast", torch.randn(13, 7, generator=g)),  # cast by torch, summed in place
        ("odd_bytes", torch.arange(13, dtype=torch.uint8)),  # tail shorter than a word
        ("big", torch.randn(1000, generator=g).to(torch.bfloat16)),  # whole 64-byte blocks
        ("transposed", torch.randn(6, 10, generator=g).t().to(torch.bfloat16)),  # strided
        ("ids", torch.arange(11, dtype=torch.int64)),
        ("empty", torch.zeros(0, 4, dtype=torch.bfloat16)),
    ]


def test_core_is_built():
    assert native.available(), "services/common/weight_sync/pack_core.c did not build"


def test_pack_and_sum_equals_torch_pack_then_sum():
    named = _named()
    [spec] = bk.iter_buckets(named, 1 << 20, torch.bfloat16, CPU, 1 << 30)
    reference = bk.fill(torch.zeros(spec.nbytes, dtype=torch.uint8), spec)
    bucket = torch.full((spec.nbytes,), 0xAB, dtype=torch.uint8)  # stale bytes from before
    sums = bk.pack_and_sum(bucket, spec.entries, spec.sources)
    assert sums is not None
    assert torch.equal(bucket, reference)  # alignment gaps are zeroed, tensors copied / cast
    assert sums.tolist() == _torch_sums(reference, spec.entries)
    for (name, t), view in zip(named, bk.bucket_views(bucket, spec.entries), strict=True):
        assert torch.equal(view, t.to(view.dtype)), name


def test_sums_equal_torch_on_random_bytes_and_ragged_extents():
    g = torch.Generator().manual_seed(2)
    buf = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    entries = [bk.TensorEntry("a", torch.uint8, (8,), 0, 8),
               bk.TensorEntry("b", torch.uint8, (200,), 64, 200),  # extent ends on a row
               bk.TensorEntry("c", torch.uint8, (4600,), 320, 4600),
               bk.TensorEntry("d", torch.uint8, (72,), 4928, 72)]  # extent cut at the end
    got = bk.checksum_tensor(buf, entries).tolist()
    assert got == _torch_sums(buf, entries)
    assert bk.checksum_tensor(buf, entries, bk.cpu_extents(entries, buf.numel())).tolist() == got


def test_sums_wrap_like_int64():
    t = torch.tensor([2**62] * 8 + [1] * 8, dtype=torch.int64)  # 128 bytes: the SIMD loop
    entry = bk.TensorEntry("t", torch.int64, (16,), 0, 128)
    assert bk.checksum_tensor(t.view(torch.uint8), [entry]).tolist() == \
        _torch_sums(t.view(torch.uint8), [entry])


@pytest.mark.parametrize("start", [0, 16])  # a 64-byte aligned bucket, and one that is not
def test_wide_paths_equal_torch_on_long_extents(start: int):
    """Extents long enough for the AVX-512 / AVX2 loops (where the CPU has them), with ragged
    ends, in a bucket whose start is or is not 64-byte aligned (the wide stores need it)."""
    g = torch.Generator().manual_seed(3)
    sizes = [4096, 70_000, 128 * 1000 + 8, 8, 300_000 + 46]
    named = [(f"t{i}", torch.randint(-2**15, 2**15, (n // 2,), dtype=torch.int16,
                                     generator=g).view(torch.bfloat16))
             for i, n in enumerate(sizes)]
    [spec] = bk.iter_buckets(named, 1 << 22, torch.bfloat16, CPU, 1 << 30)
    raw = torch.full((spec.nbytes + 128,), 0xAB, dtype=torch.uint8)
    start += -raw.data_ptr() % 64
    bucket = raw[start: start + spec.nbytes]
    sums = bk.pack_and_sum(bucket, spec.entries, spec.sources)
    assert sums is not None
    reference = bk.fill(torch.zeros(spec.nbytes, dtype=torch.uint8), spec)
    assert torch.equal(bucket, reference)
    assert sums.tolist() == _torch_sums(reference, spec.entries)
    assert bk.checksum_tensor(bucket, spec.entries).tolist() == sums.tolist()


@pytest.mark.parametrize("stream", [True, False], ids=["non-temporal", "plain"])
@pytest.mark.parametrize("start", [0, 16])
def test_plain_and_streamed_stores_pack_the_same_bytes(start: int, stream: bool,
                                                      monkeypatch: pytest.MonkeyPatch):
    """The pack's two store kinds (native.STREAM_STORES, the bench's --pack-stores A/B) give
    the same bucket and sums, and the pass counters count the bytes packed."""
    monkeypatch.setattr(native, "STREAM_STORES", stream)
    g = torch.Generator().manual_seed(4)
    named = [(f"t{i}", torch.randint(-2**15, 2**15, (n // 2,), dtype=torch.int16,
                                     generator=g).view(torch.bfloat16))
             for i, n in enumerate([64, 8192 + 8, 100_000])]
    [spec] = bk.iter_buckets(named, 1 << 22, torch.bfloat16, CPU, 1 << 30)
    raw = torch.full((spec.nbytes + 128,), 0xAB, dtype=torch.uint8)
    start += -raw.data_ptr() % 64
    bucket = raw[start: start + spec.nbytes]
    before = dict(native.PASSES)
    sums = bk.pack_and_sum(bucket, spec.entries, spec.sources)
    assert sums is not None
    reference = bk.fill(torch.zeros(spec.nbytes, dtype=torch.uint8), spec)
    assert torch.equal(bucket, reference)
    assert sums.tolist() == _torch_sums(reference, spec.entries)
    assert native.PASSES["pack_bytes"] - before["pack_bytes"] == spec.nbytes
    assert native.PASSES["pack_s"] > before["pack_s"]


@pytest.mark.parametrize("offset,nbytes,end", [(8, 8, 16), (0, 100, 200), (0, 16, 12),
                                               (0, 64, 4096)])
def test_malformed_extents_are_refused(offset, nbytes, end):
    bucket = torch.zeros(256, dtype=torch.uint8)
    ext = native.Extents([offset], [nbytes], [end])
    with pytest.raises(ValueError, match="extent"):
        native.pack_sum(bucket, ext, [torch.zeros(nbytes, dtype=torch.uint8)])


@pytest.mark.parametrize("threads", [2, 3, 5, 16])
def test_threaded_sums_equal_one_thread(threads: int):
    """The receiver's last bucket is summed over several threads: parts of >= 1 MiB cut
    across and inside extents (a 1-byte-aligned cut would break words: it must not happen)."""
    g = torch.Generator().manual_seed(4)
    sizes = [8, 3_000_000 + 6, 64, 1 << 20, 5, 2_500_000, 0, 700_001]
    entries, offset = [], 0
    for i, n in enumerate(sizes):
        entries.append(bk.TensorEntry(f"t{i}", torch.uint8, (n,), offset, n))
        offset = bk.aligned(offset + n)
    buf = torch.randint(0, 256, (offset,), dtype=torch.uint8, generator=g)
    want = _torch_sums(buf, entries)
    ext = bk.cpu_extents(entries, buf.numel())
    assert native.sums(buf, ext, 1).tolist() == want
    assert native.sums(buf, ext, threads).tolist() == want
    with bk.idle_sum_threads():
        assert bk.checksum_tensor(buf, entries, ext).tolist() == want


def test_idle_threads_follow_the_cpu_affinity():
    assert 1 <= native.idle_threads() <= native.MAX_SUM_THREADS
    assert native.idle_threads() <= len(os.sched_getaffinity(0))
    with bk.idle_sum_threads():
        assert bk._SUM_THREADS.n == native.idle_threads()
    assert bk._SUM_THREADS.n == 1
