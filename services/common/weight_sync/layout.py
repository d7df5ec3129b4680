"""Sender side: the bucket layout of a push, prepared once and reused while the trainer
pushes tensors with the same names, shapes and dtypes (every step, in steady state).

At NCCL speed a 3 MB expert tensor is on the wire for ~9 us, less than the Python work of
laying it out (header entry, pack view, checksum bounds): preparing that work once keeps the
per-push host cost to one copy launch and one comparison per tensor.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from services.common.weight_sync import buckets as bk
from services.common.weight_sync import headers as hd
from services.common.weight_sync.group import Keys


@dataclass
class LaidBucket:
    """One bucket as sent: layout, encoded header, where its sources sit in the input."""

    index: int
    entries: list[bk.TensorEntry]
    nbytes: int
    first: int  # index of its first tensor in the pushed sequence
    direct: bool
    header: str
    bounds: bk.ChecksumPlan = None  # checksum extents, prepared (bk.checksum_plan)
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # pool slot -> views

    def sources(self, named: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [t for _, t in named[self.first: self.first + len(self.entries)]]


def lay_out(spec: bk.BucketSpec, first: int, device: torch.device) -> LaidBucket:
    bounds = bk.checksum_plan(spec.entries, spec.nbytes, device)
    return LaidBucket(spec.index, spec.entries, spec.nbytes, first, spec.direct is not None,
                      hd.encode_header(spec.index, spec.nbytes, spec.entries), bounds)


def stream_layout(named, bucket_bytes: int, wire: torch.dtype, device: torch.device,
                  direct_min_bytes: int, first: int = 0, first_index: int = 0
                  ) -> Iterator[tuple[LaidBucket, list[torch.Tensor]]]:
    """Lay buckets out as the tensors stream in (a generator input: nothing is cached).
    `first` / `first_index`: position of the first tensor and number of the first bucket."""
    for spec in bk.iter_buckets(named, bucket_bytes, wire, device, direct_min_bytes,
                                first_index):
        yield lay_out(spec, first, device), spec.sources
        first += len(spec.entries)


class StreamLayout:
    """The buckets of the last streamed push (a generator input), reused bucket by bucket while
    the stream brings the same names, shapes and dtypes in the same order (the trainer's
    streamed export does, every push): a repeated bucket costs one comparison per tensor, not
    its layout, header and checksum plan (on an H200 pair the fresh layout was ~40 us a
    tensor, the push host-bound). The first tensor that differs lays the rest out afresh."""

    def __init__(self) -> None:
        self.buckets: list[tuple[LaidBucket, list[tuple[str, torch.Size, torch.dtype]]]] = []
        self.reused = 0  # buckets of the last push taken from the previous one

    def stream(self, named, bucket_bytes: int, wire: torch.dtype, device: torch.device,
               direct_min_bytes: int) -> Iterator[tuple[LaidBucket, list[torch.Tensor]]]:
        it, new, first = iter(named), [], 0
        self.reused = 0
        rest: Iterator = it
        for laid, keys in self.buckets:
            taken = list(itertools.islice(it, len(keys)))
            if not _fits(laid, keys, taken, wire, device):
                rest = itertools.chain(taken, it)
                break
            new.append((laid, keys))
            self.reused += 1
            first += len(keys)
            yield laid, [t for _, t in taken]
        for laid, sources in stream_layout(rest, bucket_bytes, wire, device, direct_min_bytes,
                                           first, len(new)):
            new.append((laid, [(e.name, torch.Size(e.shape), t.dtype)
                               for e, t in zip(laid.entries, sources, strict=True)]))
            yield laid, sources
        self.buckets = new


class PackedLayout:
    """Buckets that arrive packed (`bk.PackedBucket`, from a producer that cut its own chunks):
    each is sent in place. Its header and checksum plan are made once per distinct entries and
    position and reused while the producer yields the same entries there (push after push)."""

    def __init__(self) -> None:
        self._laid: list[tuple[tuple[bk.TensorEntry, ...], LaidBucket]] = []

    def stream(self, packed, device: torch.device
               ) -> Iterator[tuple[LaidBucket, list[torch.Tensor]]]:
        first = 0
        for index, item in enumerate(packed):
            if not isinstance(item, bk.PackedBucket):
                raise TypeError(f"weights: item {index} is a {type(item).__name__} in a "
                                "stream of packed buckets (one kind per push)")
            # a producer on another device than the wire's (a GPU trainer pushing over gloo,
            # as `r3flow local` on one GPU does): the bucket is copied to the wire's device
            buf = item.buffer if item.buffer.device == device else item.buffer.to(device)
            if index < len(self._laid) and self._laid[index][0] is item.entries:
                laid = self._laid[index][1]
            else:
                spec = bk.BucketSpec(index, list(item.entries), [buf], buf.numel(), direct=buf)
                laid = lay_out(spec, first, device)
                del self._laid[index:]
                self._laid.append((item.entries, laid))
            first += len(item.entries)
            yield laid, [buf]


def _fits(laid: LaidBucket, keys: list[tuple[str, torch.Size, torch.dtype]],
          taken: list[tuple[str, torch.Tensor]], wire: torch.dtype, device: torch.device) -> bool:
    """`taken` fills `laid` as the tensors it was laid out for did (a bucket sent in place
    needs its tensor still sendable in place)."""
    if len(taken) != len(keys) or any(n != k[0] or t.shape != k[1] or t.dtype != k[2]
                                      for (n, t), k in zip(taken, keys, strict=True)):
        return False
    return not laid.direct or bk.sendable_in_place(taken[0][1], wire, device)


class BucketLayout:
    """Every bucket of a push of a sequence of tensors, for reuse by the next push.

    `start`: lay out only `named[start:]`, its buckets numbered from `first_index` (the tail
    of a layout whose earlier buckets still fit)."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int,
                 wire: torch.dtype, device: torch.device, direct_min_bytes: int,
                 start: int = 0, first_index: int = 0) -> None:
        self.device, self.wire = device, wire
        self.buckets = [b for b, _ in stream_layout(named[start:], bucket_bytes, wire, device,
                                                    direct_min_bytes, start, first_index)]
        self.keys = [(n, t.shape, t.dtype) for n, t in named]
        self._encoded: str | None = None
        self._digest = ""

    def encoded(self) -> str:
        """Every bucket's header as one JSON list (published once per distinct layout)."""
        if self._encoded is None:
            self._encoded = "[" + ",".join(b.header for b in self.buckets) + "]"
            self._digest = hashlib.sha1(self._encoded.encode()).hexdigest()
        return self._encoded

    def digest(self) -> str:
        """Content hash of `encoded()`: what a push's `layout` key refers to."""
        self.encoded()
        return self._digest

    def fits(self, laid: LaidBucket, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """`laid`'s tensors in `named` have its names, shapes and dtypes (and a direct one is
        still sendable in place). Checked bucket by bucket, just before each is packed: the
        Python work per tensor then overlaps the broadcasts of the buckets before it."""
        lo, hi = laid.first, laid.first + len(laid.entries)
        if len(named) != len(self.keys):
            return False
        for (n, t), (name, shape, dtype) in zip(named[lo:hi], self.keys[lo:hi], strict=True):
            if n != name or not isinstance(t, torch.Tensor) or t.shape != shape \
                    or t.dtype != dtype:
                return False
        return not laid.direct or bk.sendable_in_place(named[lo][1], self.wire, self.device)

    def replace_tail(self, tail: BucketLayout) -> None:
        """Keep the buckets before `tail`'s first one, then `tail`'s."""
        k = tail.buckets[0].index if tail.buckets else len(self.buckets)
        self.buckets = self.buckets[:k] + tail.buckets
        self.keys = tail.keys
        self._encoded = None

    def __iter__(self) -> Iterator[LaidBucket]:
        return iter(self.buckets)


def refit(layout: BucketLayout | None, named: Sequence[tuple[str, torch.Tensor]],
          bucket_bytes: int, wire: torch.dtype, device: torch.device,
          direct_min_bytes: int) -> BucketLayout:
    """`layout` made to fit `named`: kept up to the first bucket whose tensors changed (names,
    shapes, dtypes), laid out anew from there; a new layout when there was none."""
    if layout is None:
        return BucketLayout(named, bucket_bytes, wire, device, direct_min_bytes)
    for laid in layout:
        if not layout.fits(laid, named):
            layout.replace_tail(BucketLayout(named, bucket_bytes, wire, device,
                                             direct_min_bytes, start=laid.first,
                                             first_index=laid.index))
            break
    return layout


def publish(root: torch.distributed.Store, layout: BucketLayout, previous: str) -> str:
    """Write `layout` under its digest in the sender's root store unless `previous` (the
    digest written last) is the same, deleting the previous one; returns the digest."""
    digest = layout.digest()
    if digest != previous:
        root.set(Keys.layout_blob(digest), layout.encoded())
        if previous:
            root.delete_key(Keys.layout_blob(previous))
    return digest
