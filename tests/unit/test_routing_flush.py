"""The encoder's 4-lane (AVX2) rANS flush against its scalar loop: the same bytes on every
input, whatever the CPU runs (the format does not depend on the instruction set). The 4-lane
flush runs on inputs of >= 65,536 rows (tokens x layers: below that the encoder skips its
reciprocal tables), so every case here has at least that many."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from services.common import routing
from tests.bench.routing_data import skewed_routing, uniform_routing

ROWS = 1 << 16  # RCP_MIN_ROWS in routing_core/core.h


@pytest.fixture
def scalar_switch():
    flag = ctypes.c_int32.in_dll(routing._LIB, "r3_scalar_flush")
    yield flag
    flag.value = 0


def _both(flag: ctypes.c_int32, ids: np.ndarray, experts: int, mode: str) -> tuple[bytes, bytes]:
    flag.value = 0
    fast = routing.encode(ids, experts, mode)
    flag.value = 1
    scalar = routing.encode(ids, experts, mode)
    flag.value = 0
    return fast, scalar


def _random_rows(rng: np.random.Generator, tokens: int, layers: int, topk: int, experts: int,
                 repeat: float) -> np.ndarray:
    """Rows drawn from a random skewed popularity (escapes, rebuilds, repeats) or uniformly."""
    dtype = np.uint8 if experts <= 256 else np.uint16
    out = np.empty((tokens, layers, topk), dtype=dtype)
    for layer in range(layers):
        logits = rng.normal(scale=rng.uniform(0.0, 3.0), size=experts)
        keys = logits[None, :] + rng.gumbel(size=(tokens, experts))
        rows = np.argsort(-keys, axis=1)[:, :topk]
        src = np.maximum.accumulate(np.where(rng.random(tokens) >= repeat, np.arange(tokens), 0))
        out[:, layer, :] = rows[src]
    return out


@pytest.mark.parametrize("mode", ["canonical", "exact"])
def test_flush_bytes_equal_scalar_on_bench_data(scalar_switch, mode: str):
    for ids in (skewed_routing(4096, layers=16), uniform_routing(2048, layers=32),
                skewed_routing(1366, layers=48, seed=1)):
        fast, scalar = _both(scalar_switch, ids, 128, mode)
        assert fast == scalar
        want = np.sort(ids, axis=-1) if mode == "canonical" else ids
        assert np.array_equal(routing.decode(fast), want)


def test_flush_bytes_equal_scalar_on_random_shapes(scalar_switch):
    rng = np.random.default_rng(7)
    for case in range(16):
        experts = int(rng.choice([9, 16, 64, 128, 160, 300]))
        topk = int(rng.integers(1, min(experts, 16) + 1))
        tokens = int(rng.choice([64, 700, 2500, 70_000]))
        layers = -(-ROWS // tokens)
        mode = "exact" if case % 3 == 0 else "canonical"
        ids = _random_rows(rng, tokens, layers, topk, experts, float(rng.uniform(0, 0.9)))
        fast, scalar = _both(scalar_switch, ids, experts, mode)
        assert fast == scalar, (experts, topk, tokens, layers, mode)
