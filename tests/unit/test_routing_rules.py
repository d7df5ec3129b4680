"""The routing rules (services/common/routing_rules.py) have one meaning in three engines: numpy
and torch (`check_ids`), the compiled validator (`check_ids_native`, the encoder's own check) and
the compiled payload walk (`check_blob`, what the store runs). Random valid and invalid inputs go
to every engine; they must accept and refuse the same ones, with the same error.

Legend: T rows, L layer columns, K top-k, E num_experts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common import routing
from services.common.routing_rules import (
    RoutingRuleError,
    RoutingSpec,
    check_blob,
    check_ids,
    check_ids_native,
    expected_rows,
)

MUTATIONS = ("none", "id_range", "duplicate", "all_zero", "rows", "layers", "layer_ids",
             "top_k", "dense")


def _valid(rng: np.random.Generator, t: int, layers: int, k: int, e: int) -> np.ndarray:
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t * layers)])
    return ids.reshape(t, layers, k).astype(np.uint8 if e <= 256 else np.uint16)


def _case(rng: np.random.Generator, mutation: str):
    """(ids, spec, layer_ids) with at most one rule broken (`mutation`)."""
    e = int(rng.choice([2, 5, 8, 64, 128, 300, 1024]))
    k = int(rng.integers(1, min(e, 8) + 1))
    if mutation in ("duplicate", "all_zero") and k == 1:
        k = 2
    t, layers = int(rng.integers(1, 40)), int(rng.integers(1, 5))
    ids = _valid(rng, t, layers, k, e)
    layer_ids = tuple(int(x) for x in sorted(rng.choice(48, layers, replace=False)))
    spec = RoutingSpec(e, top_k=k, rows=t, layer_ids=layer_ids)
    row, col = int(rng.integers(t)), int(rng.integers(layers))
    if mutation == "id_range":
        ids[row, col, rng.integers(k)] = rng.integers(e, np.iinfo(ids.dtype).max + 1)
    elif mutation == "duplicate":
        a, b = rng.choice(k, 2, replace=False)
        ids[row, col, a] = ids[row, col, b]
    elif mutation == "all_zero":
        ids[row, col] = 0
    elif mutation == "rows":
        spec = RoutingSpec(e, top_k=k, rows=t + int(rng.choice([-1, 1])), layer_ids=layer_ids)
    elif mutation == "layers":
        spec = RoutingSpec(e, top_k=k, rows=t, layer_ids=(*layer_ids, 99))
    elif mutation == "layer_ids":
        spec = RoutingSpec(e, top_k=k, rows=t, layer_ids=(*layer_ids[:-1], layer_ids[-1] + 1))
    elif mutation == "top_k":
        spec = RoutingSpec(e, top_k=k + 1, rows=t, layer_ids=layer_ids)
    elif mutation == "dense":  # an engine view: one more column, a dense layer (must be 0)
        dense = np.zeros((t, 1, k), ids.dtype)
        dense[row, 0, 0] = 1 + rng.integers(e - 1)
        ids = np.concatenate([dense, ids], axis=1)
        spec = RoutingSpec(e, top_k=k, rows=t, layer_ids=(0, *layer_ids),
                           dense_columns=(0,))
    return ids, spec, layer_ids if mutation != "dense" else (0, *layer_ids)


def _outcome(fn, *args) -> tuple | None:  # noqa: ANN001
    """None if accepted, else what the error says: (field, rule, row, column, message)."""
    try:
        fn(*args)
    except RoutingRuleError as e:
        return (e.field, e.rule, e.row, e.column, e.count, str(e))
    return None


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_numpy_torch_and_compiled_validator_agree(mutation: str) -> None:
    rng = np.random.default_rng(MUTATIONS.index(mutation))
    for _ in range(60):
        ids, spec, layer_ids = _case(rng, mutation)
        py = _outcome(check_ids, ids, spec, layer_ids)
        assert (py is None) == (mutation == "none"), (mutation, py)
        assert _outcome(check_ids_native, ids, spec, layer_ids) == py
        assert _outcome(check_ids, torch.from_numpy(ids.astype(np.int64)), spec, layer_ids) == py


def test_errors_name_the_field_row_and_layer() -> None:
    ids = _valid(np.random.default_rng(0), 6, 2, 3, 16)
    ids[4, 1] = [2, 7, 2]
    spec = RoutingSpec(16, top_k=3, rows=6, layer_ids=(3, 5))
    with pytest.raises(RoutingRuleError, match=r"^repeated expert id in row 4, layer 5 \(1 rows\)"):
        check_ids(ids, spec)
    ids[1, 0, 0] = 16
    with pytest.raises(RoutingRuleError, match=r"^expert id 16 >= num_experts 16 in row 1, layer 3"):
        check_ids_native(ids, spec)
    with pytest.raises(RoutingRuleError, match=r"^5 routing rows, expected prompt \+ response - 1 = 6"):
        check_ids(ids[:5], spec)
    with pytest.raises(RoutingRuleError, match="2 experts per token, the model routes top-3"):
        check_ids(ids[..., :2], spec)
    assert expected_rows(4, 3) == 6


def _blob_case(rng: np.random.Generator, mutation: str):
    """(blob, spec) with at most one rule broken; blobs hold MoE layers only, so an id >= the
    model's num_experts comes in a blob whose header allows it (a rollout of another model)."""
    ids, spec, _ = _case(rng, "none")
    t, layers, k = ids.shape
    model_e = header_e = spec.num_experts
    if mutation == "id_range":
        header_e = min(1024, model_e + int(rng.integers(1, 64)))
        model_e = min(model_e, header_e - 1)
        ids = ids.astype(np.uint16 if header_e > 256 else np.uint8)
        bad = int(rng.integers(model_e, header_e))
        others = [x for x in rng.permutation(header_e) if x != bad][: k - 1]
        ids[int(rng.integers(t)), int(rng.integers(layers))] = [bad, *others]
    rows, top_k, n_layers = t, k, layers
    if mutation == "rows":
        rows += 1
    elif mutation == "layers":
        n_layers += 1
    elif mutation == "top_k":
        top_k += 1
    spec = RoutingSpec(model_e, top_k=top_k, rows=rows, layers=n_layers)
    mode = routing.MODES[int(rng.integers(2))]
    return routing.encode(ids, header_e, mode), spec


@pytest.mark.parametrize("mutation", ("none", "id_range", "rows", "layers", "top_k", "corrupt"))
def test_payload_walk_agrees_with_the_rules_on_decoded_ids(mutation: str) -> None:
    """check_blob (header rules + the compiled walk, no ids built) refuses exactly the blobs
    whose decoded ids the Python rules refuse."""
    rng = np.random.default_rng(100 + len(mutation))
    for _ in range(40):
        blob, spec = _blob_case(rng, "none" if mutation == "corrupt" else mutation)
        if mutation == "corrupt":
            data = bytearray(blob)
            data[int(rng.integers(32, len(data)))] ^= 1 << int(rng.integers(8))
            blob = bytes(data)
        try:
            check_blob(blob, spec)
            walk_ok = True
        except ValueError:
            walk_ok = False
        try:
            check_ids(routing.decode(blob), spec)
            rules_ok = True
        except ValueError:
            rules_ok = False
        assert walk_ok == rules_ok == (mutation == "none"), (mutation, walk_ok, rules_ok)


def test_blob_spec_with_dense_columns_needs_the_ids() -> None:
    blob = routing.encode(_valid(np.random.default_rng(1), 4, 2, 2, 8), 8)
    with pytest.raises(ValueError, match="dense_columns"):
        check_blob(blob, RoutingSpec(8, dense_columns=(0,)))
