"""routing.check: decode's validation without the output array. Every blob, valid or damaged,
must get exactly decode's verdict: the header back where decode returns ids, the same
ValueError message where decode refuses.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_routing import (
    FUZZ,
    FUZZ_SOURCES,
    _blob,
    make_ids,
    mutate,
    routing_cases,
    with_valid_crc,
)

from services.common import _build, routing


def verdict(fn, blob: bytes) -> tuple[str, object]:
    try:
        out = fn(blob)
    except ValueError as e:
        return "refused", str(e)
    return "ok", out.shape


def assert_same_verdict(blob: bytes) -> str:
    """check and decode agree; returns decode's message ('' if the blob is valid)."""
    decoded = verdict(routing.decode, blob)
    checked = verdict(routing.check, blob)
    assert checked == decoded, (checked, decoded)
    return str(decoded[1]) if decoded[0] == "refused" else ""


@FUZZ
@given(routing_cases())
def test_check_accepts_every_valid_blob(case):
    ids_TLK = make_ids(case["seed"], case["tokens"], case["layers"], case["topk"],
                       case["experts"], case["skewed"])
    blob = routing.encode(ids_TLK, case["experts"], mode=case["mode"])
    header = routing.check(blob)
    assert header == routing.peek_header(blob)
    assert header.shape == ids_TLK.shape


@pytest.mark.parametrize("mode", routing.MODES)
def test_check_accepts_long_skewed_and_uniform_inputs(mode):
    for skewed in (True, False):  # adaptive layers, and fallback layers past 64 tokens
        ids_TLK = make_ids(3, 700, 3, 8, 128, skewed)
        assert routing.check(routing.encode(ids_TLK, 128, mode=mode)).shape == ids_TLK.shape


@pytest.mark.parametrize("source", FUZZ_SOURCES, ids=lambda s: f"{s['experts']}-{s['topk']}")
def test_check_gives_decodes_verdict_on_damaged_blobs(source):
    """Each corruption class (header, length, checksum, and past a recomputed checksum every
    payload sub-code the mutations reach) gets decode's message."""
    rng = np.random.default_rng(7_000 + source["experts"] + source["topk"])
    blob = _blob(**source)
    messages = set()
    for i in range(600):
        damaged = mutate(rng, blob)
        if i % 3 and len(damaged) >= 32:
            damaged = with_valid_crc(damaged)
        messages.add(assert_same_verdict(damaged))
    assert any("checksum mismatch" in m for m in messages)
    assert any("corrupted payload" in m for m in messages)


def test_check_matches_decode_on_long_layers():
    """Long skewed layers reach what short ones do not: rebuild intervals of thousands of rows
    (check buffers an interval's rows) and popularity counts past the counting-sort range."""
    blob = routing.encode(make_ids(4, 9_000, 2, 8, 128, skewed=True), 128)
    assert assert_same_verdict(blob) == ""
    rng = np.random.default_rng(11)
    refused = 0
    for _ in range(40):
        damaged = mutate(rng, blob)
        if len(damaged) >= 32:
            refused += assert_same_verdict(with_valid_crc(damaged)) != ""
    assert refused > 20


def test_check_and_decode_report_the_same_payload_sub_codes():
    """Across all fuzz sources, most corrupted-payload reasons are reached, each identically."""
    reasons = set()
    for n, source in enumerate(FUZZ_SOURCES):
        rng = np.random.default_rng(n)
        blob = _blob(**source)
        for _ in range(400):
            damaged = mutate(rng, blob)
            if len(damaged) >= 32:
                message = assert_same_verdict(with_valid_crc(damaged))
                if "corrupted payload: " in message:
                    reasons.add(message.split("corrupted payload: ")[1])
    assert len(reasons) >= 5, reasons


@pytest.fixture(scope="module")
def explicit_repeats_lib(tmp_path_factory):
    """A test build whose encoder codes repeated rows explicitly (invalid streams)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler")
    out = tmp_path_factory.mktemp("lib") / "core_explicit_repeats.so"
    source = Path(routing.__file__).with_name("routing_core.c")
    # -O1: this build only makes test blobs, and compiles several times faster than -O3.
    cmd = ["-O1" if a == "-O3" else a for a in _build.compile_command(source, out)]
    cmd.append("-DR3_TEST_EXPLICIT_REPEATS")
    subprocess.run(cmd, check=True)
    return routing._load_library(out)


@pytest.mark.parametrize("topk,experts", [(8, 128), (8, 300), (4, 300), (3, 20)])
@pytest.mark.parametrize("mode", routing.MODES)
def test_check_refuses_rows_coded_explicitly_as_repeats(explicit_repeats_lib, monkeypatch,
                                                        topk, experts, mode):
    """A row that repeats the previous one must be coded by the repeat flag; the check finds
    an explicit one without building rows (exact mode: same set and same order index)."""
    ids_TLK = make_ids(2, 200, 2, topk, experts, skewed=True)
    with monkeypatch.context() as m:
        m.setattr(routing, "_LIB", explicit_repeats_lib)
        blob = routing.encode(ids_TLK, experts, mode=mode)
    assert "explicit row identical to the previous one" in assert_same_verdict(blob)


def test_exact_mode_rows_with_the_same_set_in_another_order_are_no_repeats():
    rng = np.random.default_rng(4)
    ids_TLK = make_ids(6, 300, 2, 8, 128, skewed=True)
    for t in range(1, 300, 2):  # every other row: the previous row's set, shuffled
        ids_TLK[t] = rng.permuted(ids_TLK[t - 1], axis=-1)
    blob = routing.encode(ids_TLK, 128, mode="exact")
    assert routing.check(blob).shape == ids_TLK.shape
    np.testing.assert_array_equal(routing.decode(blob), ids_TLK)


def test_check_type_errors_and_header_messages():
    with pytest.raises(TypeError, match="blob: expected bytes-like"):
        routing.check("not bytes")
    blob = _blob()
    for damaged, message in ((blob[:20], "truncated header"), (blob + b"\0", "trailing"),
                             (b"XXXX" + blob[4:], "bad magic")):
        with pytest.raises(ValueError, match=message):
            routing.check(damaged)
        assert_same_verdict(damaged)


@FUZZ
@given(st.binary(min_size=0, max_size=200))
def test_check_matches_decode_on_random_bytes(data):
    assert_same_verdict(data)
    forged = routing.MAGIC + bytes([1, 0, 1, 8]) + b"\x80\x00\x00\x00" + data[:24]
    forged = forged.ljust(32, b"\0") + data[24:]
    assert_same_verdict(with_valid_crc(forged))


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_check_many_gives_each_blob_checks_verdict(threads):
    rng = np.random.default_rng(threads)
    blobs = [_blob(**source) for source in FUZZ_SOURCES]
    blobs += [with_valid_crc(mutate(rng, b)) if len(b) >= 32 else b
              for b in blobs for _ in range(20)]
    blobs += [b"", b"R3RC", _blob()[:-1]]
    results = routing.check_many(blobs, threads=threads)
    assert len(results) == len(blobs)
    for blob, result in zip(blobs, results, strict=True):
        expected = verdict(routing.check, blob)
        if isinstance(result, ValueError):
            assert expected == ("refused", str(result))
        else:
            assert expected == ("ok", result.shape) and result == routing.peek_header(blob)
    assert sum(isinstance(r, ValueError) for r in results) > 20


def test_check_many_edge_cases():
    assert routing.check_many([], threads=3) == []
    assert routing.check_many([_blob()], threads=8) == [routing.peek_header(_blob())]
    with pytest.raises(ValueError, match="threads: 0 < 1"):
        routing.check_many([_blob()], threads=0)
    with pytest.raises(TypeError, match="blob: expected bytes-like"):
        routing.check_many(["text"])
