"""Bucketing of HF-named tensors into flat wire buffers, and the per-tensor checksum.

A bucket is a flat uint8 buffer. Each tensor occupies `[offset, offset + nbytes)` with offsets
aligned to `ALIGN` bytes; its checksum (`sum64`) is the wrapping int64 sum of the 8-byte words
of its extent `[offset, min(aligned(offset + nbytes), bucket size))` (its alignment gap
included: the same bytes go on the wire). Integer addition is associative, so
the checksum is bit-identical on CPU and GPU whatever the reduction order, and it runs at
memory speed (~35 GB/s on one CPU core), far above any link it guards.

Floating tensors (fp16/bf16/fp32/fp64) travel in the wire dtype; every other dtype (integers,
bool, fp8) travels as-is. Receivers get views into the bucket buffers: no copy is made.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    from services.common.weight_sync.native import Extents

ALIGN = 64
# A layout's checksum inputs, prepared once: CUDA row bounds, CPU extents for the C core, or
# None (derived from the entries at each call)
ChecksumPlan: TypeAlias = "torch.Tensor | Extents | None"
CAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
WIRE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    *CAST_DTYPES, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)}


def default_bucket_bytes(backend: str) -> int:
    """1 GiB for NCCL (a 61 GB push at 256 MiB buckets spends its time on the host: raw/push
    0.57-0.71 against 0.88-0.89 at 1 GiB on 4 x H200, BENCHMARKS.md), 64 MiB for gloo (bounds
    the CPU staging memory)."""
    return (1024 if backend == "nccl" else 64) << 20


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name ('bfloat16', 'float16', 'float32')."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype: {name!r} is not one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def dtype_on_wire(dtype: torch.dtype, wire: torch.dtype) -> torch.dtype:
    """Floating tensors are cast to the wire dtype; anything else is sent as-is."""
    return wire if dtype in CAST_DTYPES else dtype


def padded(nbytes: int) -> int:
    """The checksummed extent: nbytes rounded up to whole 8-byte words."""
    return (nbytes + 7) // 8 * 8


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name in _DTYPES:
        return _DTYPES[name]
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype: unknown dtype {name!r} in a bucket header")
    return dtype


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in its bucket (what the receiver needs to rebuild it)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    checksum: int = 0

    def to_json(self) -> list:
        return [self.name, dtype_name(self.dtype), list(self.shape), self.offset, self.nbytes,
                self.checksum]

    @classmethod
    def from_json(cls, row: list) -> TensorEntry:
        name, dtype, shape, offset, nbytes, checksum = row
        return cls(name, dtype_from_name(dtype), tuple(shape), offset, nbytes, checksum)


@dataclass
class BucketSpec:
    """One bucket on the sender: its layout and the source tensors that fill it.

    `direct` is set when the bucket is a single tensor already contiguous in its wire dtype:
    it is broadcast in place, without packing.
    """

    index: int
    entries: list[TensorEntry] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0
    direct: torch.Tensor | None = None

    def add(self, name: str, tensor: torch.Tensor, wire: torch.dtype) -> None:
        dtype = dtype_on_wire(tensor.dtype, wire)
        offset = aligned(self.nbytes)
        nbytes = tensor.numel() * dtype.itemsize
        self.entries.append(TensorEntry(name, dtype, tuple(tensor.shape), offset, nbytes))
        self.sources.append(tensor)
        self.nbytes = aligned(offset + nbytes)  # whole ALIGN rows (see checksum_tensor)


@dataclass(frozen=True)
class PackedBucket:
    """A bucket its producer packed itself (the trainer's streamed export hands the sender whole
    chunks): `buffer` is flat uint8 of whole ALIGN rows and holds each entry at its offset in
    its wire dtype. It goes on the wire as it is; a producer that yields the same `entries`
    object push after push (a layout that repeats) has its header and checksum plan reused."""

    entries: tuple[TensorEntry, ...]
    buffer: torch.Tensor

    def __post_init__(self) -> None:
        n = self.buffer.numel()
        if self.buffer.dtype != torch.uint8 or self.buffer.dim() != 1 or n % ALIGN:
            raise ValueError(f"buffer: a packed bucket is flat uint8 of whole {ALIGN}-byte "
                             f"rows, got {self.buffer.dtype} {tuple(self.buffer.shape)}")
        if self.entries and self.entries[-1].offset + self.entries[-1].nbytes > n:
            raise ValueError(f"entries: {self.entries[-1].name!r} ends past the buffer ({n} B)")


def sendable_in_place(tensor: torch.Tensor, wire: torch.dtype, device: torch.device) -> bool:
    return (tensor.is_contiguous() and tensor.dtype == dtype_on_wire(tensor.dtype, wire)
            and tensor.device == device and tensor.nbytes % 8 == 0
            and tensor.data_ptr() % 8 == 0)


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                 wire: torch.dtype, device: torch.device,
                 direct_min_bytes: int, first_index: int = 0) -> Iterator[BucketSpec]:
    """Group tensors (streamed, in order) into buckets of at most `bucket_bytes`, numbered
    from `first_index`.

    A tensor larger than a bucket gets a bucket of its own size; one of at least
    `direct_min_bytes` that needs no cast is sent in place.
    """
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes: {bucket_bytes} < {ALIGN}")
    cur = BucketSpec(first_index)
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights[{name!r}]: expected a torch.Tensor, got {type(tensor)}")
        size = padded(tensor.numel() * dtype_on_wire(tensor.dtype, wire).itemsize)
        alone = size >= bucket_bytes or (
            size >= direct_min_bytes and sendable_in_place(tensor, wire, device))
        if cur.entries and (alone or cur.nbytes + aligned(size) > bucket_bytes):
            yield cur
            cur = BucketSpec(cur.index + 1)
        cur.add(name, tensor, wire)
        if alone:
            if sendable_in_place(tensor, wire, device):
                cur.direct = tensor.detach().reshape(-1).view(torch.uint8)
                cur.nbytes = cur.direct.numel()  # the tensor itself goes on the wire
            yield cur
            cur = BucketSpec(cur.index + 1)
    if cur.entries:
        yield cur


def fill(buf_u8: torch.Tensor, spec: BucketSpec) -> torch.Tensor:
    """Pack the spec's sources into `buf_u8` (cast to the wire dtype); returns the bucket view."""
    if spec.direct is not None:
        return spec.direct
    bucket = buf_u8[: spec.nbytes]
    with torch.no_grad():
        # one multi-tensor launch on GPU instead of one copy kernel per tensor
        torch._foreach_copy_(bucket_views(bucket, spec.entries),
                             [src.detach() for src in spec.sources])
    return bucket


def tensor_view(bucket_u8: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """The tensor `entry` as a view into its bucket (no copy)."""
    raw = bucket_u8[entry.offset: entry.offset + entry.nbytes]
    return raw.view(entry.dtype).view(entry.shape)


def bucket_views(bucket_u8: torch.Tensor, entries: list[TensorEntry]) -> list[torch.Tensor]:
    """Every entry as a view into its bucket. A single-dtype bucket is cut by one `split`
    (Python overhead per tensor is what limits a push at NCCL speed, not the bytes)."""
    dtype = entries[0].dtype if entries else torch.uint8
    if any(e.dtype != dtype for e in entries) or bucket_u8.numel() % dtype.itemsize:
        return [tensor_view(bucket_u8, e) for e in entries]
    item, sizes, pos = dtype.itemsize, [], 0
    for e in entries:  # alternating (gap, tensor) lengths in elements
        start = e.offset // item
        sizes += [start - pos, e.nbytes // item]
        pos = start + e.nbytes // item
    parts = bucket_u8.view(dtype)[:pos].split(sizes)
    return [part.view(e.shape) for part, e in zip(parts[1::2], entries, strict=True)]


def extents(entries: list[TensorEntry], bucket_nbytes: int) -> list[tuple[int, int]]:
    """The byte range each entry's checksum covers: up to the next ALIGN boundary (the gap
    travels too), or to the bucket's end (a tensor sent in place: whole words, not rows)."""
    return [(e.offset, min(aligned(e.offset + e.nbytes), bucket_nbytes)) for e in entries]


def checksum_tensor(bucket_u8: torch.Tensor, entries: list[TensorEntry],
                    bounds: ChecksumPlan = None) -> torch.Tensor:
    """sum64 of each entry's extent, as an int64 tensor on the bucket's device (no host
    sync: on GPU it queues behind the bucket's broadcast). `bounds` may be passed in (from
    `checksum_plan`) when the layout repeats. On the CPU the C core uses the threads that
    `idle_sum_threads` grants this thread (one by default)."""
    if not entries:
        return torch.zeros(0, dtype=torch.int64, device=bucket_u8.device)
    if bucket_u8.is_cuda and len(entries) > 1:
        return _segment_sums(bucket_u8, entries if bounds is None else bounds)  # type: ignore[arg-type]
    if not bucket_u8.is_cuda and bucket_u8.is_contiguous():
        native = _native()
        if native is not None:  # one GIL-free call for the bucket, not a reduction per tensor
            if not isinstance(bounds, native.Extents):
                bounds = cpu_extents(entries, bucket_u8.numel())
            return native.sums(bucket_u8, bounds, getattr(_SUM_THREADS, "n", 1))
    sums = [bucket_u8[a:b].view(torch.int64).sum()
            for a, b in extents(entries, bucket_u8.numel())]
    return torch.stack(sums)


def _native():  # noqa: ANN202 (module or None)
    """The C pack/checksum core (weight_sync/native.py), None where it cannot be built."""
    try:
        from services.common.weight_sync import native
    except ImportError:  # numpy missing (a bare GPU machine): the torch path
        return None
    return native if native.available() else None


_SUM_THREADS = threading.local()


@contextlib.contextmanager
def idle_sum_threads() -> Iterator[None]:
    """CPU checksums made by this thread inside the block may use every idle core (for a sum
    that nothing else runs beside: the receiver's last bucket, after its last byte landed)."""
    native = _native()
    _SUM_THREADS.n = native.idle_threads() if native is not None else 1
    try:
        yield
    finally:
        _SUM_THREADS.n = 1


def cpu_extents(entries: list[TensorEntry], bucket_nbytes: int) -> Extents:
    """The entries' (offset, nbytes, extent end) arrays for the C core."""
    from services.common.weight_sync import native

    return native.Extents([e.offset for e in entries], [e.nbytes for e in entries],
                          [b for _, b in extents(entries, bucket_nbytes)])


def pack_and_sum(bucket_u8: torch.Tensor, entries: list[TensorEntry],
                 sources: list[torch.Tensor], plan: ChecksumPlan = None) -> torch.Tensor | None:
    """CPU: pack `sources` into the bucket and return their checksums in one pass over the
    bytes (the C core; sources needing a cast are cast by torch first and summed in place).
    None where that path does not apply (GPU, no C core): pack with `fill`/views instead."""
    native = None if bucket_u8.is_cuda or not bucket_u8.is_contiguous() else _native()
    if native is None:
        return None
    if not isinstance(plan, native.Extents):
        plan = cpu_extents(entries, bucket_u8.numel())
    as_bytes = [s.detach() if _bytes_as_is(s, e) else None for s, e in zip(sources, entries,
                                                                          strict=True)]
    cast = [i for i, s in enumerate(as_bytes) if s is None]
    if cast:
        views = [tensor_view(bucket_u8, entries[i]) for i in cast]
        with torch.no_grad():
            torch._foreach_copy_(views, [sources[i].detach() for i in cast])
    return native.pack_sum(bucket_u8, plan, as_bytes)


def _bytes_as_is(src: torch.Tensor, entry: TensorEntry) -> bool:
    """`src` can be copied byte for byte into `entry` (no cast, contiguous, on the CPU)."""
    return (src.device.type == "cpu" and src.dtype == entry.dtype and src.is_contiguous()
            and src.numel() * src.element_size() == entry.nbytes)


def checksum_plan(entries: list[TensorEntry], bucket_nbytes: int, device: torch.device
                  ) -> ChecksumPlan:
    """What `checksum_tensor` needs of a layout, prepared once: row bounds on the GPU (for a
    bucket of several entries), the extents for the C core on the CPU, else None."""
    if device.type == "cuda":
        return row_bounds(entries, device) if len(entries) > 1 else None
    return cpu_extents(entries, bucket_nbytes) if _native() is not None else None


def row_bounds(entries: list[TensorEntry], device: torch.device) -> torch.Tensor:
    """[start, end) of each entry's extent in ALIGN-byte rows, on `device` (for a bucket of
    several entries, whose size is whole rows)."""
    bounds = torch.tensor([[e.offset // ALIGN, aligned(e.offset + e.nbytes) // ALIGN]
                           for e in entries], dtype=torch.int64)
    if device.type == "cuda":
        # from pinned memory: a pageable host->device copy would wait for the stream (that
        # is, for the bucket's broadcast) and stall the host
        bounds = bounds.pin_memory().to(device, non_blocking=True)
    return bounds


def _segment_sums(bucket_u8: torch.Tensor,
                  entries_or_bounds: list[TensorEntry] | torch.Tensor) -> torch.Tensor:
    """All entries' sums in a few kernels and one read of the bucket (a per-tensor sum costs
    ~20 us of launches each): sums of ALIGN-byte rows, a prefix sum over the (8x fewer) rows,
    differenced at the extents' ends. Wrapping int64 arithmetic keeps it exact."""
    rows = bucket_u8.view(torch.int64).view(-1, ALIGN // 8).sum(1)
    prefix = rows.new_empty(rows.numel() + 1)
    prefix[:1].zero_()  # a fill kernel: `prefix[0] = 0` copies a host scalar and syncs the stream
    torch.cumsum(rows, 0, out=prefix[1:])
    bounds = entries_or_bounds
    if not isinstance(bounds, torch.Tensor):
        bounds = row_bounds(bounds, rows.device)
    return prefix[bounds[:, 1]] - prefix[bounds[:, 0]]


def summed_on(side: torch.cuda.Stream | None, bucket_u8: torch.Tensor,
              entries: list[TensorEntry], bounds: ChecksumPlan = None
              ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """`checksum_tensor` of a bucket just queued (CPU: computed now). On CUDA it runs on the
    `side` stream after the current stream's work (the pack), so it does not hold up the next
    pack; returns the event that marks it done (the buffer may be reused after it)."""
    if side is None:
        return checksum_tensor(bucket_u8, entries, bounds), None
    side.wait_stream(torch.cuda.current_stream(bucket_u8.device))
    with torch.cuda.stream(side):
        summed = checksum_tensor(bucket_u8, entries, bounds)
    return summed, side.record_event()
