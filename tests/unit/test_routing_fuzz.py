"""Bounded fuzz of the routing codec's decode: 12,000 damaged blobs (8,000 with both checksums
recomputed so the damage reaches the payload parser) and 2,000 random byte strings. Decode must
refuse with ValueError or return ids that re-encode to exactly the blob; nothing else.
(tests/unit/test_routing.py holds the codec's own, smaller fuzz; this one is sized for issue 10.)
"""

from __future__ import annotations

import numpy as np
import pytest
from test_routing import FUZZ_SOURCES, _blob, check_decode, mutate, with_valid_crc

from services.common import routing

PER_SOURCE = 2_000  # x 6 sources = 12,000 mutated blobs


@pytest.mark.parametrize("source", FUZZ_SOURCES, ids=lambda s: f"{s['experts']}-{s['topk']}")
def test_mutated_blobs_refused_or_exact(source: dict) -> None:
    rng = np.random.default_rng(10_000 + source["experts"] * 7 + source["topk"])
    blob = _blob(**source)
    refused = 0
    for i in range(PER_SOURCE):
        damaged = mutate(rng, blob)
        if i % 3 and len(damaged) >= 32:
            damaged = with_valid_crc(damaged)  # past both checksums: the parser itself holds
        try:
            routing.decode(damaged)
        except ValueError:
            refused += 1
            continue
        check_decode(damaged)
    assert refused > PER_SOURCE // 2  # nearly every mutation is caught


def test_random_bytes_refused() -> None:
    rng = np.random.default_rng(99)
    for _ in range(2_000):
        data = rng.bytes(int(rng.integers(0, 256)))
        if rng.random() < 0.5:  # a plausible header, so more cases reach the size checks
            data = routing.MAGIC + data[4:]
        with pytest.raises(ValueError):
            routing.decode(data)
