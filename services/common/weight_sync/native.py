"""ctypes binding of pack_core.c: one-pass pack + checksum of a CPU bucket, and the checksums
of a bucket's extents in one call (see pack_core.c for why).

Optional: where the library is not built (`make setup` / `python -m services.common._build`, e.g.
no C compiler), `available()` is False (a warning says why) and the callers use the torch path, which computes the same checksums (tests compare the two).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

_I64P = ctypes.POINTER(ctypes.c_int64)
_U64P = ctypes.POINTER(ctypes.c_uint64)
_lib: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        from services.common import _build

        lib = ctypes.CDLL(str(_build.library_path("pack")))
    except (OSError, RuntimeError) as e:
        log.warning("weight sync: C pack/checksum unavailable, using torch ops (%s)", e)
        return None
    lib.ws_pack_sum.restype = ctypes.c_int32
    lib.ws_pack_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, _U64P,
                                _I64P, _I64P, _I64P, _I64P, ctypes.c_int32]
    lib.ws_sum.restype = ctypes.c_int32
    lib.ws_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, _I64P, _I64P,
                           _I64P, ctypes.c_int32]
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


# The pack's stores: non-temporal (the bucket goes to memory, past the caches) or plain.
STREAM_STORES = True

# Wall seconds and bytes of the C passes this process made (a bench reads them per push):
# "pack" = copy + sum of packed tensors, "sum" = sums alone (in place, received)
PASSES = {"pack_s": 0.0, "pack_bytes": 0, "sum_s": 0.0, "sum_bytes": 0}

# More threads than this do not sum faster: one core's loads already take a good share of a
# socket's memory bandwidth.
MAX_SUM_THREADS = 4


def idle_threads() -> int:
    """Threads for a sum that nothing else runs beside (the receiver's last bucket, after the
    last byte landed): the CPUs this process may run on, at most MAX_SUM_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_SUM_THREADS, cpus))


def _ptr(a: np.ndarray, kind=_I64P):  # noqa: ANN001, ANN202
    return a.ctypes.data_as(kind)


class Extents:
    """A bucket's per-entry (offset, nbytes, checksum end) as int64 arrays, built once per
    layout (the push repeats it)."""

    def __init__(self, offsets: Sequence[int], nbytes: Sequence[int], ends: Sequence[int]
                 ) -> None:
        self.offset = np.asarray(offsets, dtype=np.int64)
        self.nbytes = np.asarray(nbytes, dtype=np.int64)
        self.end = np.asarray(ends, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.offset)


def pack_sum(bucket_u8: torch.Tensor, ext: Extents, sources: Sequence[torch.Tensor | None]
             ) -> torch.Tensor:
    """Copy each source (None: already in place) to its offset, zero its alignment gap, and
    return the int64 checksums of the extents. Sources must be contiguous CPU tensors of
    the wire dtype. The GIL is released during the copy (ctypes)."""
    lib = _load()
    assert lib is not None and bucket_u8.device.type == "cpu" and bucket_u8.is_contiguous()
    src = np.fromiter((0 if t is None else t.data_ptr() for t in sources), dtype=np.uint64,
                      count=len(ext))
    sums = np.empty(len(ext), dtype=np.int64)
    t0 = time.perf_counter()
    rc = lib.ws_pack_sum(bucket_u8.data_ptr(), bucket_u8.numel(), len(ext), _ptr(src, _U64P),
                         _ptr(ext.offset), _ptr(ext.nbytes), _ptr(ext.end), _ptr(sums),
                         int(STREAM_STORES))
    PASSES["pack_s"] += time.perf_counter() - t0
    PASSES["pack_bytes"] += int(ext.end[-1] - ext.offset[0]) if len(ext) else 0
    if rc != 0:
        raise ValueError("bucket: an entry's extent does not fit the bucket (layout bug)")
    return torch.from_numpy(sums)


def sums(bucket_u8: torch.Tensor, ext: Extents, threads: int = 1) -> torch.Tensor:
    """int64 checksums of the extents [offset, end) of a contiguous CPU bucket, over up to
    `threads` threads (parts of at least 1 MiB; the GIL is released)."""
    lib = _load()
    assert lib is not None and bucket_u8.device.type == "cpu" and bucket_u8.is_contiguous()
    out = np.empty(len(ext), dtype=np.int64)
    t0 = time.perf_counter()
    rc = lib.ws_sum(bucket_u8.data_ptr(), bucket_u8.numel(), len(ext), _ptr(ext.offset),
                    _ptr(ext.end), _ptr(out), threads)
    PASSES["sum_s"] += time.perf_counter() - t0
    PASSES["sum_bytes"] += int(ext.end[-1] - ext.offset[0]) if len(ext) else 0
    if rc != 0:
        raise ValueError("bucket: an entry's extent does not fit the bucket (layout bug)")
    return torch.from_numpy(out)
