"""Checksums on the host: a bucket's per-tensor sums read back (one copy for a whole push),
compared with what the sender announced, and the entries that carry them. The sums themselves
are computed where the bucket is (buckets.checksum_tensor: a few kernels on the GPU, the C core
on the CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.common.weight_sync.buckets import TensorEntry, checksum_tensor


def checksums(bucket_u8: torch.Tensor, entries: list[TensorEntry]) -> list[int]:
    """sum64 of each entry's extent, on the host."""
    return checksum_tensor(bucket_u8, entries).tolist()


def host_sums(sums: list[torch.Tensor], side: torch.cuda.Stream | None,
              wait: Callable[[Callable[[], bool]], None]) -> list[list[int]]:
    """Per-bucket checksum tensors -> lists of ints on the host. On CUDA they are gathered
    and copied on `side` (the stream that computed them, which waits for the packs only, not
    for the broadcasts still in flight); `wait(ready)` polls the copy (a dead peer cannot
    hang a poll, it can hang a blocking sync)."""
    if side is None or not sums:
        return split_sums(sums)
    with torch.cuda.stream(side):
        flat = torch.cat(sums)
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        done = side.record_event()
    wait(done.query)
    return split_by(host.tolist(), [s.numel() for s in sums])


def split_sums(sums: list[torch.Tensor]) -> list[list[int]]:
    """Per-bucket checksum tensors -> per-bucket lists of ints (one host sync in all)."""
    if not sums:
        return []
    return split_by(torch.cat(sums).cpu().tolist(), [s.numel() for s in sums])


def split_by(flat: list[int], sizes: list[int]) -> list[list[int]]:
    """`flat` cut into consecutive lists of `sizes` elements."""
    out, start = [], 0
    for n in sizes:
        out.append(flat[start: start + n])
        start += n
    return out


def with_checksums(entries: list[TensorEntry], sums: list[int]) -> list[TensorEntry]:
    return [TensorEntry(e.name, e.dtype, e.shape, e.offset, e.nbytes, s)
            for e, s in zip(entries, sums, strict=True)]


def verify(bucket_u8: torch.Tensor, entries: list[TensorEntry]) -> list[str]:
    """Names of entries whose checksum does not match the bytes received."""
    got = checksums(bucket_u8, entries)
    return [e.name for e, s in zip(entries, got, strict=True) if s != e.checksum]


def mismatches(entries: list[list[TensorEntry]], got: list[list[int]],
               want: list[list[int]]) -> list[str]:
    """Names of tensors whose received checksum differs from the sender's (per bucket)."""
    if len(got) != len(want):
        return [f"<{len(want)} buckets announced, {len(got)} received>"]
    if got == want:  # the common case, compared in C (a push may have thousands of tensors)
        return []
    return [e.name for es, g, w in zip(entries, got, want, strict=True)
            for e, a, b in zip(es, g, w, strict=True) if a != b]
