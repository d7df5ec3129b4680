"""Routing alignment: wire chunks -> per-trajectory rows -> trainer MoE layers -> packed rows.

Pure numpy/torch (no megatron), so every step is unit-testable. The steps, in order:
  1. `assemble_rows`: decoded chunks placed by `start_row`; rows [0, P+R-1) covered exactly once
     (a duplicated or missing prefix is an error, never concatenated or replaced silently);
  2. `LayerMap`: engine layer columns -> this model's MoE layers (dense layers dropped),
     built from the HF config's MoE layers and the chunks' `layer_ids`;
  3. `pad_last_row`: the engine never runs the last sampled token, so row P+R-1 is missing; it is
     filled with a copy of the previous row and excluded from the agreement check (its logits
     predict nothing and are never in a loss);
  4. `to_router_rows`: a padded [B, S] micro-batch becomes the router's token order, sequence-
     major (t = s*B + b), one [S*B, K] tensor per MoE layer;
  5. `pp_stage_layers`, `shard_sequence_parallel`, `shard_context_parallel`: the slice a pipeline
     stage / sequence-parallel rank / context-parallel rank routes (CP/SP shard exactly as
     `input_ids`); `local_routing` cuts a micro-batch's routing to one rank's layers and
     positions before `to_router_rows`, so a rank replays (and checks) only its own rows.
Legend: T rows, L layer columns, K top-k, S sequence (padded), B micro-batch rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from services.common.routing_rules import RoutingRuleError, RoutingSpec, check_ids


@dataclass(frozen=True)
class RoutingChunk:
    """One decoded RoutedExperts chunk."""

    start_row: int
    ids_TLK: np.ndarray
    layer_ids: tuple[int, ...]


def assemble_rows(chunks: Sequence[RoutingChunk], total_rows: int,
                  field: str = "routing") -> tuple[np.ndarray, tuple[int, ...]]:
    """Place chunks by start_row into [total_rows, L, K]; every row exactly once. The rows keep
    the chunks' dtype (the codec's uint8/uint16: a 128k-token trajectory at 48 layers top-8 is
    50 MB, not the 393 MB of int64); they widen to int64 one micro-batch at a time on the
    device (`batch.routed_ids`)."""
    if not chunks:
        raise ValueError(f"{field}: no routing chunks")
    layer_ids, k = chunks[0].layer_ids, chunks[0].ids_TLK.shape[2]
    out_TLK = np.zeros((total_rows, len(layer_ids), k), dtype=_row_dtype(chunks))
    covered = np.zeros(total_rows, dtype=np.int32)
    for c in chunks:
        if c.layer_ids != layer_ids or c.ids_TLK.shape[2] != k:
            raise ValueError(f"{field}: chunk at row {c.start_row} has layers {c.layer_ids} / "
                             f"top-k {c.ids_TLK.shape[2]}, first chunk {layer_ids} / {k}")
        end = c.start_row + c.ids_TLK.shape[0]
        if end > total_rows:
            raise ValueError(f"{field}: chunk rows [{c.start_row}, {end}) exceed the "
                             f"{total_rows} rows of P+R-1")
        out_TLK[c.start_row:end] = c.ids_TLK
        covered[c.start_row:end] += 1
    bad = np.flatnonzero(covered != 1)
    if bad.size:
        kind = "missing" if covered[bad[0]] == 0 else "duplicated"
        raise ValueError(f"{field}: row {int(bad[0])} is {kind} ({bad.size} rows not covered "
                         f"exactly once)")
    return out_TLK, layer_ids


def _row_dtype(chunks: Sequence[RoutingChunk]) -> np.dtype:
    """The chunks' common dtype when it is the codec's uint8/uint16, else int64."""
    dtype = np.result_type(*(c.ids_TLK.dtype for c in chunks))
    return dtype if dtype in (np.dtype(np.uint8), np.dtype(np.uint16)) else np.dtype(np.int64)


@dataclass(frozen=True)
class LayerMap:
    """For each trainer MoE layer m: the engine column holding its routing."""

    columns: tuple[int, ...]
    hf_layers: tuple[int, ...]  # HF layer index of trainer MoE layer m (for messages)

    @classmethod
    def build(cls, moe_layers: Sequence[int], engine_layer_ids: Sequence[int]) -> LayerMap:
        """Map HF MoE layer indices onto the engine's layer columns; dense columns dropped."""
        pos = {int(h): c for c, h in enumerate(engine_layer_ids)}
        missing = [h for h in moe_layers if h not in pos]
        if missing:
            raise ValueError(f"layer_ids: engine routing lacks MoE layers {missing} "
                             f"(has {list(engine_layer_ids)})")
        return cls(tuple(pos[h] for h in moe_layers), tuple(moe_layers))

    def select(self, ids_TLK: np.ndarray) -> np.ndarray:
        """Engine columns -> [T, L_moe, K] in trainer MoE layer order."""
        if max(self.columns) >= ids_TLK.shape[1]:
            raise ValueError(f"layer map: column {max(self.columns)} but routing has "
                             f"{ids_TLK.shape[1]} layer columns")
        if self.columns == tuple(range(ids_TLK.shape[1])):
            return ids_TLK  # every engine column is a MoE layer, in order: no copy
        return ids_TLK[:, list(self.columns)]


def pad_last_row(ids_TLK: np.ndarray) -> np.ndarray:
    """[P+R-1, L, K] -> [P+R, L, K]: the last token's row copies the previous one."""
    return np.concatenate([ids_TLK, ids_TLK[-1:]], axis=0)


def filler_row(num_layers: int, k: int) -> np.ndarray:
    """Routing for padding positions: experts 0..k-1 (distinct ids; outputs never used)."""
    return np.broadcast_to(np.arange(k, dtype=np.int64), (num_layers, k))


def pack_routing(per_sample_TLK: Sequence[np.ndarray], seq_len: int) -> np.ndarray:
    """Per-sample [T_i, L, K] (T_i <= seq_len) -> padded [B, S, L, K] with filler rows, in the
    samples' dtype (uint8/uint16 from the codec: widened per micro-batch on the device)."""
    num_layers, k = per_sample_TLK[0].shape[1:]
    dtype = np.result_type(*(ids.dtype for ids in per_sample_TLK))
    out_BSLK = np.empty((len(per_sample_TLK), seq_len, num_layers, k), dtype=dtype)
    out_BSLK[:] = filler_row(num_layers, k)
    for b, ids in enumerate(per_sample_TLK):
        out_BSLK[b, :ids.shape[0]] = ids
    return out_BSLK


def to_router_rows(ids_BSLK: torch.Tensor) -> list[torch.Tensor]:
    """[B, S, L, K] -> per layer [S*B, K] int64 in the router's token order (t = s*B + b),
    widened layer by layer (no [T, L, K] int64 besides the rows)."""
    b, s, num_layers, k = ids_BSLK.shape
    rows_TLK = ids_BSLK.transpose(0, 1).reshape(s * b, num_layers, k)
    return [rows_TLK[:, m].long().contiguous() for m in range(num_layers)]


def pp_stage_layers(per_layer: Sequence[torch.Tensor], moe_layers: Sequence[int],
                    stage_first: int, stage_end: int) -> list[torch.Tensor]:
    """Keep the MoE layers whose HF layer index is in this pipeline stage [first, end)."""
    return [t for t, h in zip(per_layer, moe_layers, strict=True) if stage_first <= h < stage_end]


def shard_sequence_parallel(x_SB: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Sequence-parallel shard of a sequence-first tensor (as megatron scatters activations)."""
    if x_SB.shape[0] % size:
        raise ValueError(f"sequence_parallel: seq len {x_SB.shape[0]} not divisible by {size}")
    step = x_SB.shape[0] // size
    return x_SB[rank * step:(rank + 1) * step]


def shard_context_parallel(x_BS: torch.Tensor, rank: int, size: int, seq_dim: int = 1):
    """Context-parallel shard (load-balanced: chunks rank and 2*size-1-rank), as input_ids."""
    if size == 1:
        return x_BS
    n = x_BS.shape[seq_dim]
    if n % (2 * size):
        raise ValueError(f"context_parallel: seq len {n} not divisible by {2 * size}")
    chunks = x_BS.chunk(2 * size, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[2 * size - 1 - rank]], dim=seq_dim)


def local_routing(ids_BSLK: torch.Tensor, valid_BS: torch.Tensor, columns: Sequence[int],
                  pos_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing one rank replays: its pipeline stage's MoE layer `columns` and the sequence
    positions `pos_S` its routers see (SP/CP shard, in router order), with their valid flags."""
    pos_S = pos_S.to(ids_BSLK.device)
    cols = torch.as_tensor(list(columns), dtype=torch.long, device=ids_BSLK.device)
    return (ids_BSLK.index_select(1, pos_S).index_select(2, cols),
            valid_BS.index_select(1, pos_S.to(valid_BS.device)))


class InvalidRoutingError(ValueError):
    """Replay ids that cannot be a top-k choice (duplicates such as all-zero rows, out of range)."""


class RoutingLayoutError(ValueError):
    """Routing of another model: num_experts or top-k differ from the trainer's model."""


def check_routes(ids_BSLK: torch.Tensor, valid_BS: torch.Tensor, num_experts: int,
                 hf_layers: Sequence[int], top_k: int | None = None) -> None:
    """The routing rules (services/common/routing_rules.py) on a micro-batch's real rows, on
    their device: K = the model's top-k when given, K distinct ids < num_experts per row; the
    error names the layer and row."""
    spec = RoutingSpec(num_experts, top_k=top_k)
    ids = ids_BSLK[valid_BS.bool().to(ids_BSLK.device)]  # [N, L, K]
    try:
        check_ids(ids, spec)
    except RoutingRuleError as e:
        if e.field == "top_k":
            raise RoutingLayoutError(f"routing: {e} (num_experts_per_tok)") from None
        m = e.column
        assert m is not None
        raise InvalidRoutingError(
            f"routing: MoE layer {m} (HF layer {hf_layers[m]}) has invalid ids "
            f"{sorted(e.ids)} in {e.count} rows ({e})") from None
