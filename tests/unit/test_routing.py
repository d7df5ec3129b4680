"""Routing codec: lossless round trips, size bounds, validation messages, determinism, fuzzing.

Legend: ids_TLK is (tokens T, layers L, topk K); E = num_experts.
"""

from __future__ import annotations

import math
import platform
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.common import routing

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- data


def random_rows(rng: np.random.Generator, tokens: int, layers: int, topk: int, experts: int):
    """Every row a uniformly random topk-subset of range(experts), in random order."""
    keys_TLE = rng.random((tokens, layers, experts))
    ids_TLK = np.argpartition(keys_TLE, topk - 1, axis=-1)[..., :topk]
    order_TLK = np.argsort(rng.random(ids_TLK.shape), axis=-1)
    return np.take_along_axis(ids_TLK, order_TLK, axis=-1)


def skewed_rows(rng: np.random.Generator, tokens: int, layers: int, topk: int, experts: int):
    """Zipf-popular experts, and rows that often repeat the previous token's row."""
    log_pop_E = -1.2 * np.log(np.arange(1, experts + 1))[rng.permutation(experts)]
    keys_TLE = log_pop_E + rng.gumbel(size=(tokens, layers, experts))
    ids_TLK = np.argsort(-keys_TLE, axis=-1)[..., :topk]
    for t in range(1, tokens):
        repeat_L = rng.random(layers) < 0.3
        ids_TLK[t, repeat_L] = ids_TLK[t - 1, repeat_L]
    return ids_TLK


def make_ids(seed: int, tokens: int, layers: int, topk: int, experts: int, skewed: bool):
    rng = np.random.default_rng(seed)
    make = skewed_rows if skewed else random_rows
    ids_TLK = make(rng, tokens, layers, topk, experts)
    return ids_TLK.astype(np.uint8 if experts <= 256 else np.uint16)


def expected(ids_TLK: np.ndarray, mode: str) -> np.ndarray:
    return np.sort(ids_TLK, axis=-1) if mode == "canonical" else ids_TLK


def floor_bytes(ids_TLK: np.ndarray, experts: int, mode: str) -> float:
    tokens, layers, topk = ids_TLK.shape
    bits = routing.floor_bits_per_row(experts, topk)
    if mode == "exact":
        bits += math.log2(math.factorial(topk))
    return tokens * layers * bits / 8


@st.composite
def routing_cases(draw, max_tokens: int = 160):
    experts = draw(st.sampled_from([2, 3, 5, 8, 16, 17, 64, 100, 128, 129, 256, 257, 1000, 1024]))
    topk = draw(st.integers(1, min(16, experts)))
    tokens = draw(st.sampled_from([0, 1, 2, 7, 63, 64, 65, max_tokens]))
    layers = draw(st.integers(1, 3))
    return dict(
        seed=draw(st.integers(0, 2**32 - 1)),
        tokens=tokens,
        layers=layers,
        topk=topk,
        experts=experts,
        skewed=draw(st.booleans()),
        mode=draw(st.sampled_from(routing.MODES)),
    )


# ----------------------------------------------------------------------------- round trips


@FUZZ
@given(routing_cases())
def test_roundtrip_is_lossless_and_near_floor(case):
    mode, experts = case.pop("mode"), case["experts"]
    ids_TLK = make_ids(**case)
    blob = routing.encode(ids_TLK, experts, mode=mode)
    out_TLK = routing.decode(blob)
    assert out_TLK.dtype == (np.uint8 if experts <= 256 else np.uint16)
    np.testing.assert_array_equal(out_TLK, expected(ids_TLK, mode))
    # Any input: within 3% of the floor plus the fixed header (32) and rANS states (32+4).
    assert len(blob) <= 1.03 * floor_bytes(ids_TLK, experts, mode) + 68


@pytest.mark.parametrize("experts,topk", [(2, 1), (2, 2), (3, 2), (16, 16), (1024, 1), (1024, 16)])
@pytest.mark.parametrize("mode", routing.MODES)
def test_extreme_shapes_roundtrip(experts, topk, mode):
    ids_TLK = make_ids(7, 300, 2, topk, experts, skewed=False)
    blob = routing.encode(ids_TLK, experts, mode=mode)
    np.testing.assert_array_equal(routing.decode(blob), expected(ids_TLK, mode))
    assert len(blob) <= 1.03 * floor_bytes(ids_TLK, experts, mode) + 68


@pytest.mark.parametrize("mode", routing.MODES)
def test_inputs_longer_than_one_block_roundtrip(mode):
    """Tokens are coded in blocks of 65,536 (bounded encoder memory); cross a boundary."""
    ids_TLK = make_ids(13, 65_536 + 70, 1, 3, 40, skewed=True)
    blob = routing.encode(ids_TLK, 40, mode=mode)
    np.testing.assert_array_equal(routing.decode(blob), expected(ids_TLK, mode))
    assert len(blob) <= 1.03 * floor_bytes(ids_TLK, 40, mode) + 68


def test_skewed_routing_beats_the_floor_and_repeats_are_nearly_free():
    ids_TLK = make_ids(3, 2048, 4, 8, 128, skewed=True)
    blob = routing.encode(ids_TLK, 128)
    assert len(blob) < 0.8 * floor_bytes(ids_TLK, 128, "canonical")
    same_TLK = np.repeat(ids_TLK[:1], 4096, axis=0)
    assert len(routing.encode(same_TLK, 128)) < 300  # one real row per layer, then flags


def test_zero_tokens_and_header_fields():
    blob = routing.encode(np.zeros((0, 5, 4), np.uint8), 300, mode="exact")
    assert routing.decode(blob).shape == (0, 5, 4)
    assert routing.decode(blob).dtype == np.uint16
    assert routing.peek_header(blob) == routing.RoutingHeader(0, 5, 4, 300, "exact")


def test_floor_bits_per_row():
    assert routing.floor_bits_per_row(128, 8) == pytest.approx(40.3789, abs=1e-3)
    assert routing.floor_bits_per_row(2, 2) == 0.0


# ----------------------------------------------------------------------------- determinism


def test_encoding_is_deterministic_and_dtype_independent():
    ids_TLK = make_ids(11, 200, 3, 8, 128, skewed=True)
    blob = routing.encode(ids_TLK, 128)
    assert routing.encode(ids_TLK.copy(), 128) == blob
    for dtype in (np.int64, np.int32, np.uint16, np.int16):
        assert routing.encode(ids_TLK.astype(dtype), 128) == blob
    assert routing.encode(ids_TLK[:, :, ::-1], 128) == blob  # canonical ignores row order
    assert routing.encode(np.asfortranarray(ids_TLK), 128) == blob
    assert routing.encode(ids_TLK[:, :, ::-1], 128, mode="exact") != routing.encode(
        ids_TLK, 128, mode="exact"
    )


def test_portable_build_writes_the_same_bytes(tmp_path, monkeypatch):
    """The SSE4 fast paths (sorting network, CRC instruction) and plain C share one format."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None or platform.machine() != "x86_64":
        pytest.skip("needs an x86-64 C compiler")
    portable = tmp_path / "core_portable.so"
    source = Path(routing.__file__).with_name("routing_core.c")
    cmd = [compiler, "-O1", "-march=x86-64", "-std=c99", "-shared", "-fPIC", "-o", portable]
    subprocess.run([*map(str, cmd), str(source)], check=True)
    cases = [
        (make_ids(9, 300, 3, 8, 128, skewed=True), 128),
        (make_ids(9, 70, 2, 5, 300, False), 300),
    ]
    blobs = [routing.encode(ids, e, mode) for ids, e in cases for mode in routing.MODES]
    monkeypatch.setattr(routing, "_LIB", routing._load_library(portable))
    assert [routing.encode(ids, e, mode) for ids, e in cases for mode in routing.MODES] == blobs
    for blob, (ids, _), mode in zip(
        blobs, [c for c in cases for _ in routing.MODES], routing.MODES * 2, strict=True
    ):
        np.testing.assert_array_equal(routing.decode(blob), expected(ids, mode))


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "ids,experts,mode,message",
    [
        (
            np.array([[[1, 2]]] * 4, np.uint8).reshape(4, 1, 2),
            2,
            "canonical",
            r"ids\[0, 0\]: expert id 2 >= num_experts 2",
        ),
        (
            np.array([[[0, 130]]], np.uint8),
            128,
            "canonical",
            r"ids\[0, 0\]: expert id 130 >= num_experts 128",
        ),
        (
            np.array([[[0, 1], [3, 3]]], np.uint8),
            8,
            "canonical",
            r"ids\[0, 1\]: duplicate expert ids",
        ),
        (
            np.array([[[0, 1]], [[5, -1]]], np.int64),
            8,
            "canonical",
            r"ids\[1, 0\]: negative expert id -1",
        ),
        (
            np.array([[[0, 70000]]], np.int64),
            1024,
            "canonical",
            r"ids\[0, 0\]: expert id 70000 >= num_experts 1024",
        ),
        (np.zeros((2, 2), np.uint8), 8, "canonical", r"ids: expected 3 dims"),
        (np.zeros((1, 1, 2), np.float32), 8, "canonical", r"ids: dtype must be an integer"),
        (np.zeros((1, 1, 2), bool), 8, "canonical", r"ids: dtype must be an integer"),
        (np.zeros((1, 1, 17), np.uint8), 64, "canonical", r"ids.shape\[2\] \(topk\): 17"),
        (np.zeros((1, 1, 5), np.uint8), 4, "canonical", r"topk\): 5 > num_experts 4"),
        (np.zeros((1, 0, 2), np.uint8), 8, "canonical", r"ids.shape\[1\] \(layers\)"),
        (np.zeros((1, 1, 1), np.uint8), 1, "canonical", r"num_experts: 1 out of range"),
        (np.zeros((1, 1, 1), np.uint8), 1025, "canonical", r"num_experts: 1025 out of range"),
        (np.zeros((1, 1, 1), np.uint8), True, "canonical", r"num_experts: expected an int"),
        (np.zeros((1, 1, 1), np.uint8), 8, "sorted", r"mode: expected one of"),
    ],
)
def test_encode_rejects_bad_input_with_named_field(ids, experts, mode, message):
    with pytest.raises(ValueError, match=message):
        routing.encode(ids, experts, mode=mode)


def test_encode_reports_first_bad_row_in_token_order():
    ids_TLK = make_ids(5, 100, 4, 8, 128, skewed=False)
    ids_TLK[70, 3, 2] = ids_TLK[70, 3, 5]
    ids_TLK[90, 0, 0] = 200
    with pytest.raises(ValueError, match=r"ids\[70, 3\]: duplicate expert ids"):
        routing.encode(ids_TLK, 128)


def _blob(tokens=100, layers=2, topk=8, experts=128, mode="canonical", skewed=True):
    return routing.encode(make_ids(1, tokens, layers, topk, experts, skewed), experts, mode=mode)


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda b: b[:20], r"truncated header"),
        (lambda b: b[:-4], r"truncated \("),
        (lambda b: b + b"\0", r"1 trailing bytes"),
        (lambda b: b"XXXX" + b[4:], r"bad magic"),
        (lambda b: b[:4] + b"\x09" + b[5:], r"unsupported version 9"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), r"checksum mismatch"),
        (lambda b: b[:7] + b"\x20" + b[8:], r"topk 32 out of range"),
    ],
)
def test_decode_rejects_damaged_blobs(mutate, message):
    with pytest.raises(ValueError, match=message):
        routing.decode(mutate(_blob()))


def test_header_claiming_too_many_elements_is_refused_before_allocating():
    blob = bytearray(_blob())
    struct.pack_into("<II", blob, 12, 2**31 - 1, 4096)  # tokens, layers
    with pytest.raises(ValueError, match=r"exceed the cap of 2\*\*31"):
        routing.peek_header(bytes(blob))
    small = bytearray(_blob(tokens=64, layers=1))
    struct.pack_into("<II", small, 12, 2**24, 16)  # under the cap, but not in a few hundred bytes
    with pytest.raises(ValueError, match=r"cannot fit"):
        routing.decode(bytes(small))


def test_decode_type_errors():
    with pytest.raises(TypeError, match="blob: expected bytes-like"):
        routing.decode("not bytes")


# ----------------------------------------------------------------------------- fuzzing


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for byte in data:
        c = (c >> 8) ^ _CRC_TABLE[(c ^ byte) & 0xFF]
    return c ^ 0xFFFFFFFF


def with_valid_crc(blob: bytes) -> bytes:
    """Recompute the checksum so a mutation reaches the payload parser."""
    crc = crc32c(blob[:28] + blob[32:])
    return blob[:28] + struct.pack("<I", crc) + blob[32:]


def mutate(rng: np.random.Generator, blob: bytes) -> bytes:
    data = bytearray(blob)
    kind = rng.integers(6)
    if kind == 0:  # flip bits
        for _ in range(rng.integers(1, 4)):
            i = rng.integers(len(data))
            data[i] ^= 1 << rng.integers(8)
    elif kind == 1:  # random bytes
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(len(data))] = rng.integers(256)
    elif kind == 2:  # truncate
        del data[rng.integers(len(data)) :]
    elif kind == 3:  # extend
        data += rng.bytes(int(rng.integers(1, 9)))
    elif kind == 4:  # delete a span
        i = rng.integers(len(data))
        del data[i : i + rng.integers(1, 9)]
    else:  # overwrite a span of the payload
        i = rng.integers(32, max(33, len(data)))
        data[i : i + 4] = rng.bytes(4)
    return bytes(data)


def check_decode(blob: bytes) -> None:
    """Decode either refuses with ValueError or returns data that re-encodes to the blob."""
    try:
        ids_TLK = routing.decode(blob)
    except ValueError:
        return
    header = routing.peek_header(blob)
    assert routing.encode(ids_TLK, header.num_experts, mode=header.mode) == blob


FUZZ_SOURCES = [
    dict(tokens=80, layers=2, topk=8, experts=128, mode="canonical", skewed=True),
    dict(tokens=80, layers=2, topk=8, experts=128, mode="exact", skewed=True),
    dict(tokens=70, layers=1, topk=3, experts=20, mode="canonical", skewed=False),
    dict(tokens=10, layers=3, topk=16, experts=1024, mode="exact", skewed=False),
    dict(tokens=5, layers=2, topk=1, experts=2, mode="canonical", skewed=False),
    dict(tokens=200, layers=1, topk=2, experts=300, mode="canonical", skewed=True),
]


@pytest.mark.parametrize("source", FUZZ_SOURCES, ids=lambda s: f"{s['experts']}-{s['topk']}")
def test_fuzz_mutated_blobs_never_decode_wrong(source):
    rng = np.random.default_rng(source["tokens"] * 1000 + source["experts"])
    blob = _blob(**source)
    for _ in range(400):
        check_decode(mutate(rng, blob))
    for _ in range(400):  # past the checksum: the payload parser itself must hold
        damaged = mutate(rng, blob)
        check_decode(with_valid_crc(damaged) if len(damaged) >= 32 else damaged)


@FUZZ
@given(st.binary(min_size=0, max_size=200))
def test_fuzz_random_bytes_never_crash(data):
    check_decode(data)
    forged = routing.MAGIC + bytes([1, 0, 1, 8]) + struct.pack("<HH", 128, 0) + data[:24]
    forged = forged.ljust(32, b"\0") + data[24:]
    if len(forged) >= 32:
        forged = forged[:20] + struct.pack("<Q", len(forged) - 32) + forged[28:]
        check_decode(with_valid_crc(forged))
