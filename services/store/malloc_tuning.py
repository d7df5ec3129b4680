"""glibc malloc settings for the store process (`StoreConfig.malloc_keep_bytes`).

An Append message carries ~75-150 KB of routing per trajectory; parsing, splitting and
pipelining it to Redis allocates a few such buffers per message on several gRPC threads.
With glibc's defaults the arenas give freed memory back to the kernel (trim) and take it
again for the next message: each cycle costs page faults and zeroed pages (~4 % of the store's
CPU in the store benchmark's profile). Keeping up to `keep_bytes` of freed heap per arena
(and growing the heap in steps of a quarter of that) removes those cycles; buffers above
16 MiB still come from mmap and go back at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD = 16 << 20


def keep_freed_memory(keep_bytes: int) -> bool:
    """Apply the settings (glibc only); False where mallopt is unavailable or refused."""
    if keep_bytes <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("malloc_keep_bytes: mallopt not available (not glibc); left at the defaults")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, min(_MMAP_THRESHOLD, keep_bytes)),
        (_M_TRIM_THRESHOLD, keep_bytes),
        (_M_TOP_PAD, keep_bytes // 4)))
    if not ok:
        log.warning("malloc_keep_bytes: mallopt refused a setting; defaults may apply")
    return ok
