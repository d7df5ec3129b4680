"""Routing codec: lossless compression of routed-expert ids for Rollout Routing Replay.

Shapes: `ids_TLK` is (tokens T, layers L, topk K); each row (t, l) holds K distinct expert ids
in [0, E), E = num_experts. `canonical` mode sorts each row (the MoE output ignores top-k
order); `exact` mode keeps the engine's order. Encoding is deterministic (same input, same
bytes) because the store deduplicates prompt routing by comparing blobs.

Blob format, little-endian, version 2 (32-byte header, then the payload):
    0  magic b"R3RC"        4  version u8         5  mode u8 (0 canonical, 1 exact)
    6  coding u8 (0: every layer coded near-uniformly, 1: a method bit per layer)
    7  topk u8              8  num_experts u16    10 reserved u16 (0)
    12 tokens u32           16 layers u32         20 payload_len u64
    28 CRC-32C of bytes [0, 28) and the payload
    32 payload: one rANS stream; the model is documented in routing_core.c
Size on any input: the information floor log2 C(E, K) bits per row (log2 E!/(E-K)! in exact
mode) + ~0.01% (measured on uniform routing) + one bit per layer per block of 65,536 rows +
68 bytes, at most `routing_size.max_blob_bytes`; far below the floor on skewed or repetitive
routing.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from services.common import _build, routing_size

MODES = ("canonical", "exact")
MAX_TOPK = 16
MIN_EXPERTS, MAX_EXPERTS = 2, 1024
MAX_ELEMENTS = 2**31
HEADER = struct.Struct("<4sBBBBHHIIQI")
MAGIC = b"R3RC"
VERSION = 2  # 2: an adaptive layer's repeat flags precede its gaps; 1 is refused
_STATE_BYTES = 32  # four 64-bit rANS states open the payload
_PER_LAYER_MIN_TOKENS = 64  # must match PER_LAYER_MIN_TOKENS in routing_core.c

_ERR_ID_RANGE, _ERR_DUPLICATE = -3, -4
_DECODE_ERRORS = {
    -1: "out of memory",
    -2: "internal argument error",
    -5: "header inconsistent with its payload",
    -6: "length does not match the header",
    -7: "checksum mismatch (corrupted bytes)",
}
_CORRUPT_REASONS = {
    1: "payload ends before the data does (truncated or corrupted)",
    2: "subset rank or order index out of range",
    3: "expert position past the end of a row",
    4: "escape code for a symbol the model already had",
    5: "explicit row identical to the previous one (non-canonical stream)",
    6: "stream does not end in its initial state (trailing or missing data)",
    7: "decoded ids fail validation (out of range or duplicate)",
    8: "symbol in an unused code range",
}


@dataclass(frozen=True)
class RoutingHeader:
    """What a routing blob holds, read from its 32-byte header."""

    tokens: int
    layers: int
    topk: int
    num_experts: int
    mode: str

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.tokens, self.layers, self.topk)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if routing_size.ids_dtype_bytes(self.num_experts) == 1
                        else np.uint16)


def floor_bits_per_row(num_experts: int, topk: int) -> float:
    """Information floor of one canonical row: log2 C(num_experts, topk) bits."""
    return routing_size.floor_bits_per_row(num_experts, topk)


def _load_library(path: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path or _build.library_path()))
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.r3_encode.argtypes = [p, i32, i64, i64, i32, i32, i32, ctypes.POINTER(p), p]
    lib.r3_encode.restype = i64
    lib.r3_decode.argtypes = [p, i64, p, i32, p]
    lib.r3_decode.restype = i32
    lib.r3_check.argtypes = [p, i64, p]
    lib.r3_check.restype = i32
    lib.r3_check_many.argtypes = [p, p, i32, i32, p, p]
    lib.r3_check_many.restype = i32
    lib.r3_validate.argtypes = [p, i32, i64, i64, i32, i32, p]
    lib.r3_validate.restype = i32
    lib.r3_free.argtypes = [p]
    lib.r3_free.restype = None
    return lib


_LIB = _load_library()


# ----------------------------------------------------------------------------- encode


def _check_args(num_experts: int, mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, (int, np.integer)):
        raise ValueError(f"num_experts: expected an int, got {type(num_experts).__name__}")
    if not MIN_EXPERTS <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: {num_experts} out of range {MIN_EXPERTS}..{MAX_EXPERTS}")
    return MODES.index(mode)


def _check_shape(ids_TLK: np.ndarray, num_experts: int) -> None:
    if ids_TLK.ndim != 3:
        raise ValueError(f"ids: expected 3 dims (tokens, layers, topk), got shape {ids_TLK.shape}")
    if ids_TLK.dtype == np.bool_ or not np.issubdtype(ids_TLK.dtype, np.integer):
        raise ValueError(f"ids: dtype must be an integer type, got {ids_TLK.dtype}")
    tokens, layers, topk = ids_TLK.shape
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"ids.shape[2] (topk): {topk} out of range 1..{MAX_TOPK}")
    if topk > num_experts:
        raise ValueError(f"ids.shape[2] (topk): {topk} > num_experts {num_experts}")
    if layers < 1:
        raise ValueError("ids.shape[1] (layers): must be >= 1")
    if ids_TLK.size > MAX_ELEMENTS:
        raise ValueError(f"ids: {ids_TLK.size} elements exceed the cap of 2**31")


def _range_error(ids_TLK: np.ndarray, num_experts: int) -> ValueError:
    t, layer, j = np.argwhere((ids_TLK < 0) | (ids_TLK >= num_experts))[0]
    value = int(ids_TLK[t, layer, j])
    if value < 0:
        return ValueError(f"ids[{t}, {layer}]: negative expert id {value}")
    return ValueError(f"ids[{t}, {layer}]: expert id {value} >= num_experts {num_experts}")


def _as_codec_input(ids_TLK: np.ndarray, num_experts: int) -> np.ndarray:
    """C-contiguous uint8/uint16 view or copy; other integer dtypes are range-checked first."""
    if ids_TLK.dtype in (np.dtype(np.uint8), np.dtype(np.uint16)):
        return np.ascontiguousarray(ids_TLK)
    if ids_TLK.size and (ids_TLK.min() < 0 or ids_TLK.max() >= num_experts):
        raise _range_error(ids_TLK, num_experts)
    return np.ascontiguousarray(ids_TLK, dtype=np.uint8 if num_experts <= 256 else np.uint16)


def _row_error(ids_TLK: np.ndarray, num_experts: int) -> ValueError:
    info = np.zeros(4, np.int64)
    tokens, layers, topk = ids_TLK.shape
    rc = _LIB.r3_validate(
        ids_TLK.ctypes.data,
        ids_TLK.itemsize,
        tokens,
        layers,
        topk,
        num_experts,
        info.ctypes.data,
    )
    t, layer, _, value = (int(v) for v in info)
    if rc == _ERR_ID_RANGE:
        return ValueError(f"ids[{t}, {layer}]: expert id {value} >= num_experts {num_experts}")
    if rc == _ERR_DUPLICATE:
        return ValueError(f"ids[{t}, {layer}]: duplicate expert ids ({value} appears twice)")
    return ValueError(f"ids: invalid rows (validator code {rc})")


def first_invalid_row(ids_TLK: np.ndarray, num_experts: int) -> tuple[int, int] | None:
    """(token, layer) of the first row (row-major) the compiled validator refuses (an id >=
    num_experts or a repeated id: the encoder's own check), or None. ids: uint8/uint16, 3 dims
    (the rules are `routing_rules.check_ids`'s; tests hold both to the same answers)."""
    if ids_TLK.ndim != 3 or ids_TLK.dtype not in (np.dtype(np.uint8), np.dtype(np.uint16)):
        raise ValueError(f"ids: expected uint8/uint16 (tokens, layers, topk), got "
                         f"{ids_TLK.dtype} {ids_TLK.shape}")
    ids_TLK = np.ascontiguousarray(ids_TLK)
    tokens, layers, topk = ids_TLK.shape
    if tokens * layers == 0:
        return None
    info = np.zeros(4, np.int64)
    rc = _LIB.r3_validate(ids_TLK.ctypes.data, ids_TLK.itemsize, tokens, layers, topk,
                          num_experts, info.ctypes.data)
    if rc in (_ERR_ID_RANGE, _ERR_DUPLICATE):
        return int(info[0]), int(info[1])
    if rc:
        raise ValueError(f"ids: validator refused its arguments (code {rc}: topk {topk}, "
                         f"num_experts {num_experts})")
    return None


def encode(ids, num_experts: int, mode: str = "canonical") -> bytes:
    """Compress routed-expert ids (tokens, layers, topk) into a self-describing blob."""
    mode_code = _check_args(num_experts, mode)
    ids_TLK = np.asarray(ids)
    _check_shape(ids_TLK, num_experts)
    ids_TLK = _as_codec_input(ids_TLK, num_experts)
    tokens, layers, topk = ids_TLK.shape
    blob_ptr = ctypes.c_void_p()
    n = _LIB.r3_encode(
        ids_TLK.ctypes.data,
        ids_TLK.itemsize,
        tokens,
        layers,
        topk,
        num_experts,
        mode_code,
        ctypes.byref(blob_ptr),
        None,
    )
    if n in (_ERR_ID_RANGE, _ERR_DUPLICATE):
        raise _row_error(ids_TLK, num_experts)
    if n < 0:
        raise MemoryError("routing encode: out of memory") if n == -1 else RuntimeError(n)
    try:
        return ctypes.string_at(blob_ptr, n)
    finally:
        _LIB.r3_free(blob_ptr)


# ----------------------------------------------------------------------------- decode


def _as_byte_array(blob) -> np.ndarray:
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"blob: expected bytes-like, got {type(blob).__name__}")
    return np.frombuffer(blob, dtype=np.uint8)


def _row_bits_positive(num_experts: int, topk: int, mode: int) -> bool:
    return math.comb(num_experts, topk) > 1 or (mode == 1 and topk >= 2)


def _check_header_fields(version, mode, coding, topk, num_experts, reserved) -> None:
    if version != VERSION:
        raise ValueError(
            f"routing blob: unsupported version {version} (this reader knows {VERSION}; "
            "re-encode older blobs)"
        )
    if mode > 1:
        raise ValueError(f"routing blob header: mode byte {mode} is not 0 or 1")
    if coding > 1 or reserved:
        raise ValueError("routing blob header: coding/reserved bytes hold unknown values")
    if not 1 <= topk <= MAX_TOPK:
        raise ValueError(f"routing blob header: topk {topk} out of range 1..{MAX_TOPK}")
    if not MIN_EXPERTS <= num_experts <= MAX_EXPERTS or topk > num_experts:
        raise ValueError(
            f"routing blob header: num_experts {num_experts} out of range "
            f"{max(MIN_EXPERTS, topk)}..{MAX_EXPERTS}"
        )


def _check_header_sizes(header: RoutingHeader, coding: int, payload_len: int) -> None:
    tokens, layers, topk = header.shape
    mode = MODES.index(header.mode)
    if layers < 1:
        raise ValueError("routing blob header: layers is 0")
    if tokens * layers * topk > MAX_ELEMENTS:
        raise ValueError(
            f"routing blob header: {tokens}x{layers}x{topk} ids exceed the cap of 2**31"
        )
    if payload_len < _STATE_BYTES or (payload_len - _STATE_BYTES) % 4:
        raise ValueError(f"routing blob header: payload_len {payload_len} is not 32 + 4n")
    informative = _row_bits_positive(header.num_experts, topk, mode)
    if coding != int(tokens >= _PER_LAYER_MIN_TOKENS and informative):
        raise ValueError(f"routing blob header: coding byte {coding} does not match the shape")
    # Every informative row costs >= 2^-15 bits, so a short payload cannot claim a huge array.
    if informative and tokens * layers > layers + (payload_len * 8 + 256) * 32768:
        raise ValueError(
            f"routing blob header: {tokens}x{layers} rows cannot fit in {payload_len} bytes"
        )


def _parse_header(data: np.ndarray) -> tuple[RoutingHeader, int]:
    if len(data) < HEADER.size:
        raise ValueError(f"routing blob: truncated header ({len(data)} of {HEADER.size} bytes)")
    fields = HEADER.unpack(data[: HEADER.size].tobytes())
    magic, version, mode, coding, topk, num_experts, reserved, tokens, layers, payload_len, _ = (
        fields
    )
    if magic != MAGIC:
        raise ValueError(f"routing blob: bad magic {magic!r} (expected {MAGIC!r})")
    _check_header_fields(version, mode, coding, topk, num_experts, reserved)
    header = RoutingHeader(tokens, layers, topk, num_experts, MODES[mode])
    _check_header_sizes(header, coding, payload_len)
    return header, payload_len


def peek_header(blob) -> RoutingHeader:
    """Read and validate only the 32-byte header (no checksum or payload work)."""
    return _parse_header(_as_byte_array(blob))[0]


def _check_length(n_bytes: int, payload_len: int) -> None:
    expected = HEADER.size + payload_len
    if n_bytes < expected:
        raise ValueError(f"routing blob: truncated ({n_bytes} bytes, header says {expected})")
    if n_bytes > expected:
        raise ValueError(f"routing blob: {n_bytes - expected} trailing bytes after the payload")


def _decode_error(rc: int, info: np.ndarray) -> ValueError:
    if rc == -8:
        reason = _CORRUPT_REASONS.get(int(info[0]), "corrupted payload")
        return ValueError(f"routing blob: corrupted payload: {reason}")
    return ValueError(f"routing blob: {_DECODE_ERRORS.get(rc, f'error {rc}')}")


def _raise_for(rc: int, info: np.ndarray) -> None:
    if rc == -1:
        raise MemoryError("routing decode: out of memory")
    if rc:
        raise _decode_error(rc, info)


def decode(blob) -> np.ndarray:
    """Blob -> ids (tokens, layers, topk); uint8 if num_experts <= 256 else uint16."""
    data = _as_byte_array(blob)
    header, payload_len = _parse_header(data)
    _check_length(len(data), payload_len)
    ids_TLK = np.empty(header.shape, dtype=header.dtype)
    info = np.zeros(4, np.int64)
    rc = _LIB.r3_decode(
        data.ctypes.data, len(data), ids_TLK.ctypes.data, ids_TLK.itemsize, info.ctypes.data
    )
    _raise_for(rc, info)
    return ids_TLK


def check(blob) -> RoutingHeader:
    """Validate a blob as decode() does, with the same errors, without materialising the ids.

    Every check of decode runs (header, CRC-32C, each coded value range-checked, no row coded
    explicitly as a repeat, the stream ending in its initial state), so a blob that passes
    decodes to ids < num_experts, distinct within each row. Returns the blob's header.
    """
    data = _as_byte_array(blob)
    header, payload_len = _parse_header(data)
    _check_length(len(data), payload_len)
    info = np.zeros(4, np.int64)
    _raise_for(_LIB.r3_check(data.ctypes.data, len(data), info.ctypes.data), info)
    return header


def check_many(blobs: Sequence[bytes], threads: int = 1) -> list[RoutingHeader | ValueError]:
    """`check` of each blob, the payload walks in one call on up to `threads` threads (one
    release of the GIL for the batch); blob i's header, or the ValueError check would raise."""
    if threads < 1:
        raise ValueError(f"threads: {threads} < 1")
    out: list[RoutingHeader | ValueError] = []
    todo: list[tuple[int, np.ndarray]] = []  # (index, bytes) of blobs whose header passed
    for i, blob in enumerate(blobs):
        data = _as_byte_array(blob)
        try:
            header, payload_len = _parse_header(data)
            _check_length(len(data), payload_len)
        except ValueError as e:
            out.append(e)
            continue
        out.append(header)
        todo.append((i, data))
    if todo:
        _check_payloads(todo, threads, out)
    return out


def _check_payloads(todo: list[tuple[int, np.ndarray]], threads: int,
                    out: list[RoutingHeader | ValueError]) -> None:
    n = len(todo)
    ptrs = np.array([data.ctypes.data for _, data in todo], np.uintp)
    lens = np.array([len(data) for _, data in todo], np.int64)
    rcs, infos = np.zeros(n, np.int32), np.zeros((n, 4), np.int64)
    _LIB.r3_check_many(ptrs.ctypes.data, lens.ctypes.data, n, threads, rcs.ctypes.data,
                       infos.ctypes.data)
    for (i, _), rc, info in zip(todo, rcs.tolist(), infos, strict=True):
        if rc == -1:
            raise MemoryError("routing check: out of memory")
        if rc:
            out[i] = _decode_error(rc, info)
