"""Seeded synthetic routed-expert data sets for the codec and store benchmarks.

Shapes: `ids_TLK` is (tokens, layers, topk), rows hold distinct expert ids in engine order
(the order in which they were drawn, most likely first), dtype uint8 (num_experts <= 256) or
uint16.
"""

from __future__ import annotations

import numpy as np


def _out_dtype(num_experts: int) -> type[np.unsignedinteger]:
    return np.uint8 if num_experts <= 256 else np.uint16


def _topk_by_keys(keys_TE: np.ndarray, topk: int) -> np.ndarray:
    """Indices of the topk largest keys per row, largest first (the engine's topk order)."""
    part_TK = np.argpartition(-keys_TE, topk - 1, axis=1)[:, :topk]
    order_TK = np.argsort(-np.take_along_axis(keys_TE, part_TK, axis=1), axis=1)
    return np.take_along_axis(part_TK, order_TK, axis=1)


def uniform_routing(
    tokens: int, layers: int = 48, topk: int = 8, num_experts: int = 128, seed: int = 0
) -> np.ndarray:
    """Every (token, layer) row is a uniformly random topk-subset in random order."""
    rng = np.random.default_rng(seed)
    ids_TLK = np.empty((tokens, layers, topk), dtype=_out_dtype(num_experts))
    for layer in range(layers):
        keys_TE = rng.random((tokens, num_experts))
        ids_TLK[:, layer, :] = _topk_by_keys(keys_TE, topk)
    return ids_TLK


def _repeat_source(tokens: int, repeat_prob: float, rng: np.random.Generator) -> np.ndarray:
    """For each token, the index of the latest token at or before it that drew a fresh row."""
    fresh_T = rng.random(tokens) >= repeat_prob
    if tokens:
        fresh_T[0] = True
    idx_T = np.where(fresh_T, np.arange(tokens), 0)
    return np.maximum.accumulate(idx_T) if tokens else idx_T


def skewed_routing(
    tokens: int,
    layers: int = 48,
    topk: int = 8,
    num_experts: int = 128,
    seed: int = 0,
    zipf_exponent: float = 1.2,
    repeat_prob: float = 0.3,
) -> np.ndarray:
    """Per layer: Zipf popularity over a random expert permutation; rows repeat the previous
    token's row with probability `repeat_prob`, else draw topk experts by popularity without
    replacement (Gumbel top-k is exactly sequential sampling without replacement)."""
    rng = np.random.default_rng(seed)
    ids_TLK = np.empty((tokens, layers, topk), dtype=_out_dtype(num_experts))
    log_zipf_E = -zipf_exponent * np.log(np.arange(1, num_experts + 1))
    for layer in range(layers):
        log_pop_E = log_zipf_E[rng.permutation(num_experts)]
        keys_TE = log_pop_E[None, :] + rng.gumbel(size=(tokens, num_experts))
        rows_TK = _topk_by_keys(keys_TE, topk)
        ids_TLK[:, layer, :] = rows_TK[_repeat_source(tokens, repeat_prob, rng)]
    return ids_TLK
