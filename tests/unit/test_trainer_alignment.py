"""Routing alignment without megatron: row assembly, layer map, padding, router order, shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.samples.alignment import (
    InvalidRoutingError,
    LayerMap,
    RoutingChunk,
    assemble_rows,
    check_routes,
    pack_routing,
    pad_last_row,
    pp_stage_layers,
    shard_context_parallel,
    shard_sequence_parallel,
    to_router_rows,
)


def _ids(rows: int, layers: int = 3, k: int = 2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(8)[:k] for _ in range(rows * layers)]).reshape(rows, layers, k)


def test_assemble_rows_places_chunks_by_start_row():
    full = _ids(10)
    chunks = [RoutingChunk(6, full[6:], (0, 1, 2)), RoutingChunk(0, full[:4], (0, 1, 2)),
              RoutingChunk(4, full[4:6], (0, 1, 2))]
    got, layers = assemble_rows(chunks, 10)
    assert np.array_equal(got, full) and layers == (0, 1, 2)


@pytest.mark.parametrize("chunks,msg", [
    ([(0, 4), (3, 10)], "row 3 is duplicated"),  # a resumed segment re-sent the prefix
    ([(0, 4), (5, 10)], "row 4 is missing"),
    ([(0, 4), (4, 11)], "exceed"),
])
def test_assemble_rows_rejects_gaps_overlaps_and_overflow(chunks, msg):
    full = _ids(11)
    with pytest.raises(ValueError, match=msg):
        assemble_rows([RoutingChunk(a, full[a:b], (0, 1, 2)) for a, b in chunks], 10)


def test_layer_map_drops_dense_layers_and_names_missing_ones():
    lm = LayerMap.build(moe_layers=(1, 2), engine_layer_ids=(0, 1, 2))
    ids = _ids(5)
    assert lm.columns == (1, 2) and np.array_equal(lm.select(ids), ids[:, 1:])
    assert LayerMap.build((1, 2), (1, 2)).columns == (0, 1)  # engine reports MoE layers only
    with pytest.raises(ValueError, match=r"lacks MoE layers \[2\]"):
        LayerMap.build((1, 2), (0, 1))


def test_pad_last_row_and_pack_into_router_order():
    a, b = _ids(4, 2), _ids(6, 2, seed=1)
    padded = [pad_last_row(a), pad_last_row(b)]
    assert padded[0].shape == (5, 2, 2) and np.array_equal(padded[0][4], a[3])
    packed = torch.from_numpy(pack_routing(padded, 8))  # [B=2, S=8, L, K]
    rows = to_router_rows(packed)
    assert len(rows) == 2 and rows[0].shape == (16, 2) and rows[0].dtype == torch.int64
    # sequence-major: router row t = s*B + b
    assert torch.equal(rows[1][3 * 2 + 1], torch.from_numpy(b[3, 1]))
    assert torch.equal(rows[0][2 * 2 + 0], torch.from_numpy(a[2, 0]))
    assert torch.equal(rows[0][7 * 2 + 0], torch.tensor([0, 1]))  # filler past the end


def test_check_routes_names_layer_of_all_zero_rows():
    ids = torch.from_numpy(_ids(6, 2))[None]
    valid = torch.ones(1, 6, dtype=torch.bool)
    check_routes(ids, valid, 8, (1, 2))
    ids[0, 2:, 1] = 0
    with pytest.raises(InvalidRoutingError, match=r"MoE layer 1 \(HF layer 2\).*4 rows"):
        check_routes(ids, valid, 8, (1, 2))
    check_routes(ids, torch.tensor([[True, True, False, False, False, False]]), 8, (1, 2))


def test_pp_and_sequence_and_context_parallel_slices():
    per_layer = [torch.full((4, 2), m) for m in range(3)]
    assert [int(t[0, 0]) for t in pp_stage_layers(per_layer, (1, 2, 3), 2, 4)] == [1, 2]
    x = torch.arange(8 * 2).view(8, 2)  # [S, B]
    assert torch.equal(shard_sequence_parallel(x, 1, 2), x[4:])
    tokens = torch.arange(8).view(1, 8)  # [B, S]; CP=2: rank 0 gets chunks 0 and 3
    assert shard_context_parallel(tokens, 0, 2).tolist() == [[0, 1, 6, 7]]
    assert shard_context_parallel(tokens, 1, 2).tolist() == [[2, 3, 4, 5]]
    with pytest.raises(ValueError, match="context_parallel"):
        shard_context_parallel(torch.arange(6).view(1, 6), 0, 2)


def test_check_routes_refuses_another_top_k():
    from trainer.samples.alignment import RoutingLayoutError

    ids = torch.from_numpy(_ids(6, 2))[None]  # top-2 rows
    valid = torch.ones(1, 6, dtype=torch.bool)
    check_routes(ids, valid, 8, (1, 2), top_k=2)
    with pytest.raises(RoutingLayoutError, match="2 experts per token, the model routes top-3"):
        check_routes(ids, valid, 8, (1, 2), top_k=3)
