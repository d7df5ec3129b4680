"""Routing rules, written once: what the routed-expert ids of one trajectory must look like.

Used by the rollout (before a trajectory leaves the worker), the store (on every append) and the
trainer (before a micro-batch replays its routing). A `RoutingSpec` says what is expected; the
checks raise `RoutingRuleError` naming the field, row and layer, and each caller adds its context
(request id, proto field, trainer layer names).

The rules, for ids of shape (rows T, layers L, top-k K):
  * shape: 3 dims; T = prompt + response - 1 (`expected_rows`: the last token's routing is
    never computed); K = the model's top-k; the layer ids (or their count) are the model's;
  * MoE columns: every id in [0, num_experts), K distinct ids per row. An all-zero row of a
    top-k >= 2 layer is the capture-bug signature (named as such). With top-1 nothing about
    zeros is wrong: every token may go to expert 0;
  * dense columns (an engine view that keeps dense layers): all zero.

Two implementations of the id rules, one meaning (tests/unit/test_routing_rules.py feeds both
the same random valid and invalid inputs): `check_ids` (numpy or torch arrays, vectorised) and
the compiled core (`check_blob`: the codec's payload walk, `check_ids_native`: its validator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RoutingSpec:
    """The routing one model produces. `None` leaves a property unchecked.

    num_experts: ids are < num_experts. top_k: K. rows: T. layer_ids: the layer id of each
    column, in order (a chunk's `layer_ids`); layers: the column count alone. moe_columns:
    the columns that hold routed ids (None: all but `dense_columns`); dense_columns: columns
    that must be all zero (dense layers in an engine view of every layer)."""

    num_experts: int
    top_k: int | None = None
    rows: int | None = None
    layer_ids: tuple[int, ...] | None = None
    layers: int | None = None
    moe_columns: tuple[int, ...] | None = None
    dense_columns: tuple[int, ...] = ()

    def columns(self, n_columns: int) -> tuple[int, ...]:
        if self.moe_columns is not None:
            return self.moe_columns
        return tuple(c for c in range(n_columns) if c not in self.dense_columns)


class RoutingRuleError(ValueError):
    """A broken routing rule. `field`: shape, rows, top_k, layers, layer_ids, num_experts,
    dense, ids; `rule` (for ids): id_range, negative, duplicate, all_zero; `row`/`column`: the
    first offending row and column; `count`: offending rows in that column."""

    def __init__(self, field: str, message: str, *, rule: str = "", row: int | None = None,
                 column: int | None = None, count: int = 0, ids: list[int] | None = None):
        super().__init__(message)
        self.field, self.rule, self.row, self.column = field, rule, row, column
        self.count, self.ids = count, ids or []


def expected_rows(prompt_len: int, response_len: int) -> int:
    """Routing rows of a trajectory of P prompt and R response tokens: P + R - 1 (every token
    but the last was an input to the forward pass that produced the next)."""
    return prompt_len + response_len - 1


def check_rows(rows: int, spec: RoutingSpec) -> None:
    if spec.rows is not None and rows != spec.rows:
        raise RoutingRuleError("rows", f"{rows} routing rows, expected prompt + response - 1 = "
                                       f"{spec.rows}")


def check_layout(spec: RoutingSpec, *, layers: int, top_k: int,
                 num_experts: int | None = None,
                 layer_ids: Sequence[int] | None = None) -> None:
    """The layout rules, in this order: layer count, top-k, (for a blob, which carries it)
    num_experts, layer ids."""
    want_layers = len(spec.layer_ids) if spec.layer_ids is not None else spec.layers
    if want_layers is not None and layers != want_layers:
        raise RoutingRuleError("layers", f"{layers} layers, expected {want_layers}")
    if spec.top_k is not None and top_k != spec.top_k:
        raise RoutingRuleError("top_k", f"{top_k} experts per token, the model routes "
                                        f"top-{spec.top_k}")
    if num_experts is not None and num_experts != spec.num_experts:
        raise RoutingRuleError("num_experts", f"num_experts {num_experts}, the model has "
                                              f"{spec.num_experts}")
    if spec.layer_ids is not None and layer_ids is not None \
            and tuple(int(x) for x in layer_ids) != spec.layer_ids:
        raise RoutingRuleError("layer_ids", f"layer ids {list(layer_ids)}, expected "
                                            f"{list(spec.layer_ids)}")


def check_shape(shape: Sequence[int], spec: RoutingSpec,
                layer_ids: Sequence[int] | None = None) -> None:
    """Rank, row count and layout of an ids array's shape."""
    if len(shape) != 3:
        raise RoutingRuleError("shape", f"routing must be [rows, layers, topk], got shape "
                                        f"{tuple(shape)}")
    check_rows(int(shape[0]), spec)
    check_layout(spec, layers=int(shape[1]), top_k=int(shape[2]), layer_ids=layer_ids)


def _sorted_last(x: Any) -> Any:
    return np.sort(x, axis=-1) if isinstance(x, np.ndarray) else x.sort(-1).values  # torch


def _nonzero(mask: Any) -> Any:
    return np.argwhere(mask) if isinstance(mask, np.ndarray) else mask.nonzero()  # torch


def invalid_rows(ids_TLK: Any, num_experts: int) -> Any:
    """[T, L] mask of rows breaking the id rules (an id outside [0, num_experts), or two equal
    ids). Works on numpy arrays and torch tensors (on their device)."""
    srt = _sorted_last(ids_TLK)
    bad = (srt[..., -1] >= num_experts) | (srt[..., 0] < 0)
    if srt.shape[-1] > 1:
        bad = bad | (srt[..., 1:] == srt[..., :-1]).any(-1)
    return bad


def _row_error(row_K: list[int], num_experts: int, row: int, column: int, layer: int,
               count: int) -> RoutingRuleError:
    where = f"in row {row}, layer {layer} ({count} rows)"
    kw: dict[str, Any] = {"row": row, "column": column, "count": count, "ids": row_K}
    if max(row_K) >= num_experts:
        return RoutingRuleError("ids", f"expert id {max(row_K)} >= num_experts {num_experts} "
                                       f"{where}", rule="id_range", **kw)
    if min(row_K) < 0:
        return RoutingRuleError("ids", f"negative expert id {min(row_K)} {where}",
                                rule="negative", **kw)
    if not any(row_K):
        return RoutingRuleError("ids", f"all-zero row (capture bug?) {where}", rule="all_zero",
                                **kw)
    return RoutingRuleError("ids", f"repeated expert id {where}", rule="duplicate", **kw)


def check_ids(ids_TLK: Any, spec: RoutingSpec, layer_ids: Sequence[int] | None = None, *,
              native: bool = False) -> None:
    """Every rule on an ids array (numpy, or a torch tensor checked on its device): shape,
    dense columns all zero, then the id rules on the MoE columns; the error names the first
    offending row (lowest row, then column) and the layer (its id from spec.layer_ids or
    `layer_ids` when known, else the column). `native`: the id rules run by the compiled
    core's validator (`r3_validate`, what the encoder runs; uint8/uint16 numpy ids)."""
    check_shape(tuple(ids_TLK.shape), spec, layer_ids)
    names = tuple(layer_ids) if layer_ids is not None else spec.layer_ids
    for col in spec.dense_columns:
        if ids_TLK[:, col].any():
            raise RoutingRuleError("dense", f"dense layer {col} has routed experts (layer map "
                                            "does not match the engine)", column=col)
    cols = spec.columns(int(ids_TLK.shape[1]))
    if not cols or ids_TLK.shape[0] == 0:
        return
    moe = ids_TLK if len(cols) == ids_TLK.shape[1] and cols == tuple(range(len(cols))) \
        else ids_TLK[:, list(cols)]
    bad = _first_native(moe, spec.num_experts) if native else _first(moe, spec.num_experts)
    if bad is None:
        return
    row, c, count = bad
    raise _row_error([int(x) for x in moe[row, c].tolist()], spec.num_experts, row, cols[c],
                     names[cols[c]] if names is not None else cols[c], count)


def _first(moe_TLK: Any, num_experts: int) -> tuple[int, int, int] | None:
    """(row, column, bad rows in that column) of the first row breaking the id rules."""
    bad_TL = invalid_rows(moe_TLK, num_experts)
    if not bad_TL.any():
        return None
    row, c = (int(x) for x in _nonzero(bad_TL)[0])
    return row, c, int(bad_TL[:, c].sum())


def _first_native(moe_TLK: np.ndarray, num_experts: int) -> tuple[int, int, int] | None:
    from services.common import routing

    bad = routing.first_invalid_row(np.ascontiguousarray(moe_TLK), num_experts)
    if bad is None:
        return None
    row, c = bad
    column = moe_TLK[:, c:c + 1].astype(np.int64)
    return row, c, int(invalid_rows(column, num_experts).sum())


def check_ids_native(ids_TLK: np.ndarray, spec: RoutingSpec,
                     layer_ids: Sequence[int] | None = None) -> None:
    """`check_ids` with the id rules run by the compiled validator: same rules, same errors."""
    check_ids(ids_TLK, spec, layer_ids, native=True)


def check_blob(blob: bytes, spec: RoutingSpec, layer_ids: Sequence[int] | None = None) -> Any:
    """Every rule on an encoded routing blob without decoding it: the header's shape and
    num_experts against the spec, then the compiled payload walk (ids < num_experts, distinct
    per row: `routing.check`). Returns the blob's RoutingHeader. Blobs hold MoE layers only:
    a spec with dense columns needs the ids (`check_ids`)."""
    from services.common import routing

    if spec.dense_columns:
        raise ValueError("check_blob: spec.dense_columns needs the decoded ids (check_ids)")
    header = routing.peek_header(blob)
    check_rows(header.tokens, spec)
    check_layout(spec, layers=header.layers, top_k=header.topk, num_experts=header.num_experts,
                 layer_ids=layer_ids)
    return routing.check(blob)
